// The one interface between the ISA-free MoE driver (csrc/moe) and the
// kernels (csrc/kernels/<isa>/, kernels/brgemm.h): a kernel multiplies a run
// of 16-row blocks of ONE expert's projection with a tile of m activation
// rows and writes the dot products. SwiGLU and the routing-weight scale are
// the driver's epilogue, not the kernels'. Two shapes of kernel family fit
// it: the streaming families of ProjectionKernels (decode: one 16-row block
// at a time, read once, register-tiled over the tokens) and the tile
// families of TileKernel (prefill: whole token tiles to a matrix engine,
// oneDNN's brgemm or kt_ops' own tiles). Which family computes an expert's
// products is the plan's decision (kernels/plan.h), never a kernel's.
//
// Kernels never allocate, never spawn threads and assume valid input (the op
// layer validated it). Every buffer a kernel writes besides `out` is handed
// to it: the decode block of dot_fp32, the u8 tiles of dot_u8 and a tile
// kernel's A operand and TileScratch. Their one owner is the plan's per-call
// scratch (kernels/plan.h, CallScratch: one ThreadScratch per pool thread),
// which sizes them before the kernel runs. The one exception is oneDNN's own
// state behind at::native::cpublas::brgemm (its JIT kernels, cached per
// shape and thread by libtorch; released by TileKernel::release).
#pragma once

#include <cstdint>
#include <vector>

#include "formats/format_table.h"
#include "formats/qint.h"

namespace kt::kernels {

// One projection of every expert, as the kernels see it (pointers into the
// validated packed tensors; csrc/moe/moe_layer.h builds it).
struct ProjectionView {
  formats::Layout layout;
  // kQint: bits, signedness, table, implicit zero, group size and the scale /
  // zero storage types of this projection.
  formats::QintFormat qint;
  const uint8_t* weight;  // [E][row_blocks][block_bytes]
  const void* scales;     // kQint: [E][row_blocks][groups][16]; kFp8: [E][ceil(n/128)][ceil(k/128)]
                          // (fp8_row_scales: [E][row_blocks][groups][16] in qint.scale_type)
  const void* zeros;      // kQint with explicit zeros: like scales; else nullptr
  int64_t n, k;           // dense [n, k] per expert (nn.Linear convention)
  int64_t kp;             // K extent of the activations (multiple of 32; bf16 reads ceil(k/2)*2)
  int64_t row_blocks;     // ceil(n / 16)
  int64_t groups;         // kQint: scale groups along K
  int64_t block_bytes;    // bytes of one 16-row block
  bool fp8_row_scales = false;  // kFp8: scales per row and group (qint.group_size, 0: channel)
  // kGrid: the i-quant of the blocks (formats/grid.h); qint is then the int8 panel each
  // block decodes to, kp / 32 groups (the plan decodes, kernels see a kQint panel).
  formats::GridType grid = formats::GridType::kNone;

  const uint8_t* block(int64_t e, int64_t nb) const {
    return weight + (e * row_blocks + nb) * block_bytes;
  }
};

// out[i * ldo + 16 * (nb - nb_begin) + r] = sum_k W_e[16 nb + r][k] * x_i[k]
// for i < m, nb in [nb_begin, nb_end), r < 16 (rows past n may hold anything).
// What every kernel family reads: the weights (a run of blocks of one
// expert), the m activation rows in the two forms the driver makes per call,
// and the output. What one family reads beyond it (the u8 tiles of
// ProjectionKernels::dot_u8, the decode block of dot_fp32, the bf16 / u8 A
// operand and the scratch of a TileKernel) is an argument of that family's
// entry point, made by the plan (kernels/plan.h).
struct DotArgs {
  const ProjectionView* proj;
  int64_t expert;
  int64_t nb_begin, nb_end;
  const float* const* x;     // m fp32 rows, proj->kp long, zero padded past k
  const uint8_t* const* xq;  // m q8 records (formats/q8_activations.h) of the same rows, or
                             // nullptr when the format's activation type is kF32
  int m;
  float* out;
  int64_t ldo;  // >= 16 * (nb_end - nb_begin)
};

// Tokens per tile of the u8 streaming kernel (kernels/qint_tiles.h,
// qint8_u8_block_dot) and of pack_u8_tiles.
constexpr int kU8TileRows = 12;

// The u8 tiles of ProjectionKernels::dot_u8 for m q8 records of kp codes:
// the tile of rows [i0, i0 + mt) (i0 a multiple of kU8TileRows, mt =
// min(kU8TileRows, m - i0)) at dst + i0 * kp as [kp / 4][mt][4]: the 4-byte
// k-quads of the tile's tokens side by side, codes shifted to u8 (code ^ 0x80
// = code + 128), so the kernel broadcasts every token's quad from one
// pointer (12 row pointers spilled to the stack and reloaded per line
// before). dst: m * kp bytes.
inline void pack_u8_tiles(const uint8_t* const* records, int m, int64_t kp, uint8_t* dst) {
  for (int i0 = 0; i0 < m; i0 += kU8TileRows) {
    const int mt = m - i0 < kU8TileRows ? m - i0 : kU8TileRows;
    uint8_t* tile = dst + i0 * kp;
    for (int i = 0; i < mt; ++i) {
      const uint8_t* codes = records[i0 + i];
      for (int64_t q = 0; q < kp / 4; ++q)
        for (int b = 0; b < 4; ++b)
          tile[(q * mt + i) * 4 + b] = static_cast<uint8_t>(codes[q * 4 + b] ^ 0x80u);
    }
  }
}

// The streaming kernel families of one layout on one ISA tier (a column of
// the tier table, kernels/dispatch.cpp).
struct ProjectionKernels {
  const char* name;  // "<isa>/<kernel>", reported by kt_ops.info() and the tests
  // The format's own path: q8 integer dot products (kQint), E4M3 decoded in
  // registers (kFp8), bf16 widened in registers (kBf16).
  void (*dot)(const DotArgs&);
  // The weight-only path (w4a16 style): each block decoded once to fp32 in
  // `block` (16 * proj->kp floats), then fp32 FMAs with x. nullptr where
  // `dot` already multiplies fp32 activations with exact weights (bf16).
  void (*dot_fp32)(const DotArgs&, float* block);
  const char* fp32_name;
  // `dot` for 8-bit signed codes (int8, q8_0) with the activations' codes as
  // u8 tiles (pack_u8_tiles of DotArgs::xq): vpdpbusd, u8 x s8, with a
  // per-line compensation (the AVX512_VNNI tier); the same results as `dot`.
  // nullptr on tiers without it.
  void (*dot_u8)(const DotArgs&, const uint8_t* x_u8) = nullptr;
  // Which column of a format's fp32-path policy applies to these kernels
  // (formats::Fp32Policy: the break-evens differ with the streaming kernel's speed).
  formats::Fp32Class fp32_class = formats::Fp32Class::kBase;
};

// Row stride (elements) of the bf16 A operands of the tile kernels (an
// expert's gathered rows, the driver's bf16 GLU outputs, fp8's scaled rows):
// kp plus one 64-byte line, so that rows a multiple of 4 KiB apart (H =
// 2048) do not all fall into one L1 set, where the up to 28 rows one tile
// broadcasts from would evict each other at every k step.
constexpr int64_t tile_rows_ld(int64_t kp) { return kp + 32; }

// Blocks per call of a tile kernel that computes a group of 16-row blocks at
// once and keeps the group's results for its other blocks (fp8 on oneDNN's
// brgemm: N = 32, faster per column than N = 16).
constexpr int kTileGroupBlocks = 2;

// What a tile kernel keeps on one pool thread from one of its calls to the
// next within one op call (TileKernel::keeps): A rows it made from DotArgs::x
// (fp8: bf16(x * scale) of one 128-row band) and the dot products of a group
// of blocks. Owned by the plan (kernels/plan.h): one per pool thread per op
// call, sized by reserve() before such a kernel runs and emptied by reset()
// when an op call starts, so a key names rows of the current call only.
// Kernels read and write it, never grow it.
struct TileScratch {
  struct Slot {
    // `rows` was made from these m rows of DotArgs::x and these scales
    // (x == nullptr: empty).
    const float* const* x = nullptr;
    int m = 0;
    const float* scales = nullptr;
    bool packed = false;  // `rows` packed as kt_ops' tiles read them (pack_pair_tiles)
    uint64_t last_use = 0;
    std::vector<uint16_t> rows;  // >= m * tile_rows_ld(kp)
    std::vector<float> sums;     // >= m * kp / 16: sums of `rows` per sums_k k (qint)
    int64_t sums_k = 0;          // 0: `sums` not made for these rows
  };
  // The dot products of a group of kTileGroupBlocks blocks (`group`: its first block)
  // with m rows of DotArgs::x, kept for the group's other blocks (x == nullptr or
  // group == nullptr: none). Apart from the rows: gate and up read the same rows and
  // alternate block by block (moe_forward.cpp), so each keeps its own group here
  // (with one entry per rows slot, fp8_channel's and mxfp8's unit-scaled rows, shared
  // by gate and up, had every group computed twice: 1.5x the time on oneDNN's brgemm).
  struct Results {
    const float* const* x = nullptr;
    int m = 0;
    const uint8_t* group = nullptr;
    uint64_t last_use = 0;
    std::vector<float> out;  // >= m * 16 * kTileGroupBlocks
  };
  Slot slots[2];  // gate and up alternate within a task: one slot each
  Results results[2];
  uint64_t uses = 0;
  std::vector<uint16_t> tile;  // >= kp * 16 * kTileGroupBlocks: decoded weight blocks
  std::vector<float> params;   // >= 2 * kp: one block's scales and zeros per group (qint)

  // For m rows of kp: grows the buffers (the plan, before the kernel runs).
  void reserve(int m, int64_t kp) {
    const size_t rows = static_cast<size_t>(m) * tile_rows_ld(kp);
    const size_t out = static_cast<size_t>(m) * 16 * kTileGroupBlocks;
    const size_t sums = static_cast<size_t>(m) * (kp / 16);
    for (Slot& s : slots) {
      if (s.rows.size() < rows) s.rows.resize(rows);
      if (s.sums.size() < sums) s.sums.resize(sums);
    }
    for (Results& r : results)
      if (r.out.size() < out) r.out.resize(out);
    const size_t t = static_cast<size_t>(kp) * 16 * kTileGroupBlocks;
    if (tile.size() < t) tile.resize(t);
    if (params.size() < static_cast<size_t>(2 * kp)) params.resize(static_cast<size_t>(2 * kp));
  }
  // The slot that `match` accepts (*hit = true), else the least recently used one (for
  // the caller to refill); either way marked as used now.
  template <class Match>
  Slot& find(const Match& match, bool* hit) {
    return lru(slots, match, hit);
  }
  // The results of `group` for these m rows of x (*hit = true), else the least recently
  // used entry, emptied and keyed to x and m (the caller computes the group and sets
  // `group`); either way marked as used now.
  Results& find_results(const float* const* x, int m, const uint8_t* group, bool* hit) {
    Results& r = lru(
        results, [&](const Results& c) { return c.x == x && c.m == m && c.group == group; }, hit);
    if (!*hit) {
      r.x = x;
      r.m = m;
      r.group = nullptr;
    }
    return r;
  }
  // Forgets every kept result (the plan, when an op call starts); keeps the memory.
  void reset() {
    for (Slot& s : slots) {
      s.x = nullptr;
      s.last_use = 0;
    }
    for (Results& r : results) {
      r.x = nullptr;
      r.group = nullptr;
      r.last_use = 0;
    }
    uses = 0;
  }
  size_t bytes() const {
    size_t n = tile.capacity() * sizeof(uint16_t) + params.capacity() * sizeof(float);
    for (const Slot& s : slots)
      n += s.rows.capacity() * sizeof(uint16_t) + s.sums.capacity() * sizeof(float);
    for (const Results& r : results) n += r.out.capacity() * sizeof(float);
    return n;
  }

 private:
  template <class Entry, class Match>
  Entry& lru(Entry (&entries)[2], const Match& match, bool* hit) {
    Entry* pick = &entries[0];
    *hit = false;
    for (Entry& e : entries) {
      if (match(e)) {
        pick = &e;
        *hit = true;
        break;
      }
      if (e.last_use < pick->last_use) pick = &e;
    }
    pick->last_use = ++uses;
    return *pick;
  }
};

// The A operand of a tile kernel, made by the plan for each expert.
enum class TileInput : uint8_t {
  kBf16Rows,     // TileOperand::rows: the m rows rounded to bf16, [m][ld] uint16_t,
                 // zero padded past k to an even count
  kQ8Packed,     // TileOperand::rows: TileKernel::pack of the m q8 records DotArgs::xq
                 // (e.g. the u8s8 brgemm's codes + 128 with compensation rows); the
                 // kernel reads the records' scales from DotArgs::xq
  kFp32Rows,     // none: the kernel reads DotArgs::x (and makes its own A in TileScratch)
  kI8TokenRows,  // TileOperand::rows: TileKernel::pack_rows of the m fp32 rows DotArgs::x
                 // (the w8a8 kernel's per-token int8 codes + 128 and their scales)
  kBf16Packed,   // TileOperand::rows: TileKernel::pack_bf16 of the kBf16Rows rows (kt_ops'
                 // vdpbf16ps tiles: each row tile's k pairs side by side, one pointer)
};

// What a tile kernel gets besides DotArgs.
struct TileOperand {
  const void* rows;      // TileKernel::input's rows, or nullptr (kFp32Rows)
  int64_t ld;            // kBf16Rows: elements from one row to the next
  TileScratch* scratch;  // this pool thread's, for this op call (TileKernel::keeps)
};

// The quant-activation modes (kernels/plan.h, QuantActivations) under which a tile
// kernel runs, as bits of TileKernel::quant_modes.
enum QuantModeBits : uint8_t {
  kQuantAutoBit = 1,
  kQuantQ8Bit = 2,
  kQuantFp32Bit = 4,
  kAnyQuantMode = 7,
};

// A tile (matrix-engine) kernel family of one layout: a row of the tier
// table (kernels/dispatch.cpp), which chains each to its fallback. The plan
// (kernels/plan.h) takes the first of a chain that applies to the format and
// runs here, and gives it the experts with at least the format row's
// BrgemmPolicy tokens; where none runs, the streaming families compute.
struct TileKernel {
  const char* name;  // "onednn/brgemm_bf16" etc.: kt_ops.compute_paths() reports it
  TileInput input;
  // Whether it rounds the activations to bf16: 'auto' takes it only for bf16
  // hidden states (fp32 / fp16 ones keep their precision on the streaming
  // kernels). A kernel on q8 records (kQ8Packed) can reproduce the streaming
  // q8 bits, and never runs with quantized activations off.
  bool bf16_activations_only;
  bool keeps;  // whether it uses TileOperand::scratch (the plan sizes it first)
  // The formats of the layout it computes; nullptr: all.
  bool (*applies)(const formats::FormatRow& format);
  // Whether it runs in this process now: CPU features, the build, torch's
  // oneDNN (enabled, probed once per type), kt_ops settings.
  bool (*runs)();
  void (*dot)(const DotArgs& a, const TileOperand& op);
  // kQ8Packed: the A operand of m q8 records of kp codes, pack_bytes(m, kp)
  // bytes written by pack (once per expert and op call, by the pool thread
  // that computes the expert); nullptr otherwise.
  int64_t (*pack_bytes)(int m, int64_t kp);
  void (*pack)(const uint8_t* const* records, int m, int64_t kp, uint8_t* dst);
  // Run after each pool thread's run of calls (oneDNN: brgemm_release, the
  // AMX tile configuration); nullptr: nothing to release.
  void (*release)();
  const TileKernel* fallback;  // tried where this one does not run
  // kI8TokenRows: the A operand of m fp32 rows of kp, pack_bytes(m, kp) bytes,
  // written by pack_rows (once per expert, rows source and op call); nullptr otherwise.
  void (*pack_rows)(const float* const* x, int m, int64_t kp, uint8_t* dst) = nullptr;
  // QuantModeBits: per-token int8 activations only under 'auto', the q8 records'
  // kernels not under 'fp32', an exact kernel for a quantized format only there.
  uint8_t quant_modes = kAnyQuantMode;
  // Where `keeps` is false: whether it uses TileOperand::scratch in this call after all
  // (oneDNN's bf16 kernel with its blocks in pairs, brgemm::bf16_pairs); nullptr: never.
  bool (*keeps_if)() = nullptr;
  // Whether it computes only where 'brgemm' is forced (the LoRA forward forces it):
  // the format row's threshold belongs to another kernel of the chain.
  bool forced_only = false;
  // Of the formats it applies to, the projections it computes (e.g. int4 per channel
  // only, not its groups); nullptr: all. The others stream.
  bool (*applies_to)(const ProjectionView& view) = nullptr;
  // kBf16Packed: the A operand of m bf16 rows of kp (ld apart, zero past k),
  // pack_bytes(m, kp) bytes written by pack_bf16 (once per expert, rows source and op
  // call, by the pool thread that computes the expert); nullptr otherwise.
  void (*pack_bf16)(const uint16_t* rows, int64_t ld, int m, int64_t kp, uint8_t* dst) = nullptr;
  // Two projections' one-block runs with the same rows and operand (gate and up of an
  // expert: a0, a1 with the same m, k and ldo) in one pass, each A tile loaded once for
  // both; nullptr: two dot calls.
  void (*dot_pair)(const DotArgs& a0, const DotArgs& a1, const TileOperand& op) = nullptr;
};

// The q8 activation record of one fp32 row x[kp] (formats/q8_activations.h),
// vectorized per tier (kernels/q8_quantize.h).
using QuantizeRowQ8 = void (*)(const float* x, int64_t kp, uint8_t* rec);

// Lines to prefetch to L2 while a kernel computes: `lines` 64-byte lines in chunks of
// 2^chunk_lines_log2 lines, chunk c at base + c * stride (line i: chunk i >> log2, line
// i & (2^log2 - 1) of it). The source of the next weight panel, strided over the blocks.
struct PrefetchChunks {
  const void* base = nullptr;
  int64_t stride = 0;
  int chunk_lines_log2 = 0;
  int64_t lines = 0;
};

}  // namespace kt::kernels
