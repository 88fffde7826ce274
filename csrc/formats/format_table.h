// The weight-format table: one row per format (ggml's type-traits table), bf16
// included, holding every fact the op layer, the driver, the packers and
// Python need. Python builds its FormatSpec objects from this table
// (kt_ops._C.formats(); kt_ops/formats/spec.py), so there is no second
// registry. Adding a format that fits an existing layout is one row here,
// its packer in kt_ops/formats and its test. docs/formats.md has the layouts.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "formats/grid.h"
#include "formats/qint.h"

namespace kt::formats {

// The packed layout family of a format; the kernels are written per layout.
enum class Layout : uint8_t {
  kBf16,  // formats/bf16.h: [E, ceil(N/16), ceil(K/2), 16, 2] bf16
  kQint,  // formats/qint.h: integer code planes + [E, NB, G, 16] scales (zeros)
  kFp8,   // formats/fp8.h: [E, NB, Kp, 16] E4M3 + 128x128 fp32 block scales (or, with
          // FormatRow::fp8_row_scales, one scale per row and group: [E, NB, G, 16])
  kGrid,  // formats/grid.h: GGUF's i-quant bytes per 16-row block, [E, NB, 16 * K/256 * bytes],
          // decoded per block to the int8 panel of the qint layout (FormatRow::qint) for its
          // kernels
};

// Whether a format stores explicit zeros (value = scale*q - zero).
enum class ZeroPolicy : uint8_t { kNever, kOptional, kRequired };

// Never take the weight-only fp32 path under 'auto'.
constexpr int kNoFp32Path = std::numeric_limits<int>::max();

// Never take the brgemm path under 'auto' (kt_ops.set_compute_path).
constexpr int kNoBrgemm = std::numeric_limits<int>::max();

// The CPU classes on which oneDNN's brgemm ukernel runs a format's product
// natively (kernels/brgemm.h finds the class at run time, and checks with a
// probe call that oneDNN does run the type):
//   kAvx512:      AVX-512 F/BW/VL/DQ with AVX512_BF16 (bf16) / AVX512_VNNI (int8);
//   kAvx512Intel: the same on an Intel CPU without AMX (Cooper Lake; Sapphire Rapids
//                 and later with AMX off, as VMs without the AMX state run them), whose
//                 vdpbf16ps runs at a quarter of its FMA's instruction rate (measured,
//                 one core of a Xeon with AVX512_FP16: 1.47 against 6.1 G instructions/s;
//                 AMD Zen 4 runs both at one rate), so bf16 products stream as fp32
//                 FMAs there (kernels::brgemm_class);
//   kAmx:         AMX-BF16 / AMX-INT8 tiles.
// Without them (AVX2, or AVX-512 without BF16) oneDNN runs no bf16 brgemm
// and the streaming kernels stay.
enum class BrgemmIsa : uint8_t { kAvx512, kAvx512Intel, kAmx };
constexpr int kNumBrgemmIsas = 3;

// Compute-path policy of 'auto' between the streaming kernels and brgemm:
// experts with at least min_tokens[isa] tokens run their products as brgemm
// calls; kNoBrgemm: never (no brgemm path for the format, or it never wins).
// Measured break-evens, docs/formats.md "Compute paths".
struct BrgemmPolicy {
  int min_tokens[kNumBrgemmIsas];
  int min(BrgemmIsa isa) const { return min_tokens[static_cast<int>(isa)]; }
};

// The kernel classes of the 'auto' switch to the weight-only fp32 path
// (kernels::ProjectionKernels::fp32_class says which a kernel set is in): kVnni
// where the streaming kernel has its fast form, kBase elsewhere. The fast forms:
// the q8 kernel multiplying 8-bit codes with vpdpbusd on u8 activations
// (avx512_vnni; kBase: the sign trick, pmaddubsw), and fp8's E4M3 decoded by
// byte tables (AVX-512 with VBMI; kBase: AVX2's fp16 bit moves and F16C).
enum class Fp32Class : uint8_t { kBase, kVnni };
constexpr int kNumFp32Classes = 2;

// Experts with at least min_tokens[class] tokens take the fp32 path;
// kNoFp32Path: never (always the format's own streaming kernel).
struct Fp32Policy {
  int min_tokens[kNumFp32Classes];
  int min(Fp32Class c) const { return min_tokens[static_cast<int>(c)]; }
};

struct FormatRow {
  const char* name;
  Layout layout;
  QintFormat qint;                   // kQint: bits, signedness, code table, implicit zero
  std::vector<int64_t> group_sizes;  // group_size values accepted (0: per output channel)
  int64_t default_group_size;        // what the packers use when none is given
  ScaleType packed_scale_type;       // scale dtype the packers write (kNone: no scales)
  ZeroPolicy zeros;
  // What the streaming kernel multiplies the weights with: kQ8 (int8
  // activations per 32, integer dot products) or kF32.
  ActType activation;
  // Compute-path policy of 'auto' (kt_ops.set_quant_activations): experts
  // with at least this many tokens decode each block to fp32 and run fp32
  // FMAs (the weight-only path), per kernel class (Fp32Policy); measured
  // break-evens, docs/formats.md "Compute paths".
  Fp32Policy fp32_min_tokens;
  // Compute-path policy of kt_ops.set_compute_path('auto'): from how many
  // tokens per expert oneDNN's brgemm computes the products, per CPU class.
  BrgemmPolicy brgemm;
  double bits_per_weight;  // at the default group size, scales and zeros included
  const char* source;      // where the element format is specified
  // GGUF (ggml) block types: weights and bytes of one ggml block (ggml-common.h's
  // block_<type>, gguf.GGML_QUANT_SIZES), which the repacker (kt_ops/formats/
  // gguf_blocks.py) reads; {0, 0} for the other formats.
  struct GgufBlock {
    int64_t weights = 0;
    int64_t bytes = 0;
  } gguf_block = {};
  // kFp8 only: scales [E, NB, G, 16] per row and group of group_size k (0: per output
  // channel; formats/fp8.h), in packed_scale_type (fp32, or UE8M0 bytes for mxfp8),
  // instead of one fp32 scale per 128x128 block.
  bool fp8_row_scales = false;
  // kGrid only: which i-quant the blocks hold (qint then describes the decoded panel:
  // signed 8-bit codes, fp32 scales per 32).
  GridType grid = GridType::kNone;

  // Bits of one stored weight code.
  int bits() const;
  bool group_size_allowed(int64_t g) const;
};

// Every format, in the order of docs/formats.md.
const std::vector<FormatRow>& format_table();

// The format called `name`, or nullptr.
const FormatRow* find_format(const std::string& name);

// "bf16, int8, ..." for error messages.
std::string known_format_names();

}  // namespace kt::formats
