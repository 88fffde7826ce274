#include "moe/expert_weights.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "formats/bf16.h"
#include "formats/format_table.h"
#include "formats/fp8.h"
#include "formats/grid.h"
#include "formats/qint.h"
#include "formats/scale_dtype.h"
#include "kernels/brgemm.h"
#include "kernels/tiers.h"
#include "runtime/cpu_features.h"

namespace kt::moe {

namespace {

// bf16 n16k2 blocks (csrc/formats/bf16.h): packed[nb, kp, r, j] = W[16 nb + r, 2 kp + j].
// Decoded into W^T ([k, n] row-major): the 16 lanes of one (nb, kp) line hold
// W[16 nb + r, 2 kp] in their low and W[16 nb + r, 2 kp + 1] in their high
// halves, i.e. 16 consecutive elements of W^T rows 2 kp and 2 kp + 1. A shift
// and a mask widen them (no shuffle), and the loop over r vectorizes.
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The transposed decoders read a panel's columns of one 16-row block, a short run (1-2 KiB)
// 24-64 KiB past the previous block's, a page away: the hardware prefetchers start cold on
// each, so the decoders ask for the run of the block kPrefetchBlocks ahead (the AVX2 bf16
// backward on Zen 4 at T = 512: 412-424 ms without, 342-350 two blocks ahead, 298-319
// four, 301-352 eight).
constexpr int64_t kPrefetchBlocks = 4;

inline void prefetch_lines(const uint8_t* from, const uint8_t* to) {
  for (const uint8_t* p = from; p < to; p += 64) __builtin_prefetch(p);
}

// Columns [ka, kb) of W (ka even) as W^T rows: W[16 nb + r, kk] -> wt[(kk - ka) * ld + 16 nb + r].
void dequantize_bf16_transposed(const Projection& p, int64_t expert, float* wt, int64_t ld,
                                int64_t ka, int64_t kb) {
  constexpr int kRows = formats::kBf16BlockRows;
  const int64_t n = p.n, k = kb;
  const int64_t blocks = formats::bf16_row_blocks(n);
  const int64_t pairs = formats::bf16_k_pairs(k);
  const int64_t block_elems = formats::bf16_block_elems(p.k);
  const auto* base =
      reinterpret_cast<const uint16_t*>(p.weight.data_ptr()) + expert * blocks * block_elems;
  constexpr int64_t kLine = kRows * formats::kBf16KPack;  // bf16 values per (nb, kp) line
  const int64_t full_pairs = k / 2;  // pairs whose odd element is inside [ka, kb)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
    const uint16_t* block = base + nb * block_elems;
    float* col = wt + nb * kRows;  // W^T row kk - ka
    if (rows == kRows) {
      // Fixed trip counts: the compiler turns these into shifts, masks and full-line stores.
      // One line is 16 lanes of (even, odd) bf16 pairs: a shift and a mask give the two
      // fp32 rows. Written with vector extensions, which the baseline x86-64 build lowers
      // to SSE2 (the scalar loop it made of the plain form took a fifth of the backward),
      // 4 lanes per vector: GCC lowered a 16-lane vector type through copies on the stack,
      // 3.7-8x slower (one Zen 3 core decoding a down projection, a micro-benchmark).
      typedef uint32_t Lanes __attribute__((vector_size(16)));
      // The same line of the block kPrefetchBlocks ahead, asked for as each is decoded.
      const bool ahead = nb + kPrefetchBlocks < blocks;
      for (int64_t kp = ka / 2; kp < full_pairs; ++kp) {
        const uint16_t* src = block + kp * kLine;
        if (ahead) __builtin_prefetch(src + kPrefetchBlocks * block_elems);
        float* dst = col + (2 * kp - ka) * ld;
#pragma GCC unroll 4
        for (int q = 0; q < kRows / 4; ++q) {
          Lanes l;  // read without aliasing the bf16 storage
          std::memcpy(&l, src + 8 * q, sizeof(l));
          const Lanes even = l << 16, odd = l & 0xFFFF0000u;
          std::memcpy(dst + 4 * q, &even, sizeof(even));
          std::memcpy(dst + ld + 4 * q, &odd, sizeof(odd));
        }
      }
    } else {
      for (int64_t kp = ka / 2; kp < full_pairs; ++kp) {
        uint32_t l[kRows];
        std::memcpy(l, block + kp * kLine, sizeof(l));
        for (int64_t r = 0; r < rows; ++r) {
          col[(2 * kp - ka) * ld + r] = bits_to_float(l[r] << 16);
          col[(2 * kp + 1 - ka) * ld + r] = bits_to_float(l[r] & 0xFFFF0000u);
        }
      }
    }
    if (full_pairs < pairs && kb == p.k) {  // odd k: the last pair holds one real value
      uint32_t l[kRows];
      std::memcpy(l, block + full_pairs * kLine, sizeof(l));
      for (int64_t r = 0; r < rows; ++r) col[(k - 1 - ka) * ld + r] = bits_to_float(l[r] << 16);
    }
  }
}

// ---------------------------------------------------------------------------
// qint and fp8: both store 16-row blocks whose bytes for one k (fp8) or one
// word of 4 / 8 k (qint) hold all 16 rows side by side, so they decode, like
// bf16, into W^T: every k gives 16 contiguous floats. The inner loops run
// over the 16 rows with the same shift for every row: plain 32-bit lane
// arithmetic that the compiler vectorizes (SSE2 is enough). Values are
// computed exactly as kt_ops.formats.dequantize_weights does (same fp32
// operations in the same order; this file is built with -ffp-contract=off so
// no FMA fuses them), hence bit-identical to it.

constexpr int kRows = formats::kQintBlockRows;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Writes one decoded line (row r of the block -> W^T[kk, 16 nb + r]).
inline void store_line(const float* line, float* dst, int64_t rows) {
  if (rows == kRows) {
    std::memcpy(dst, line, kRows * sizeof(float));
  } else {
    std::memcpy(dst, line, rows * sizeof(float));
  }
}

// The 16 scales (or zeros) of one (block, group) as fp32: index is the
// element offset of the first of them.
void load_params(const void* base, formats::ScaleType type, int64_t index, float* out) {
  switch (type) {
    case formats::ScaleType::kF32:
      std::memcpy(out, static_cast<const float*>(base) + index, kRows * sizeof(float));
      return;
    case formats::ScaleType::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + index;
      for (int r = 0; r < kRows; ++r) out[r] = formats::half_bits_to_float(p[r]);
      return;
    }
    case formats::ScaleType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + index;
      for (int r = 0; r < kRows; ++r) out[r] = bits_to_float(static_cast<uint32_t>(p[r]) << 16);
      return;
    }
    case formats::ScaleType::kE8M0: {
      // mxfp4 scale 2^(E-128), exact down to the subnormals (the reference
      // does not flush them as formats::scale_value does for the kernels).
      const uint8_t* p = static_cast<const uint8_t*>(base) + index;
      for (int r = 0; r < kRows; ++r) {
        const uint32_t e = p[r];
        out[r] = bits_to_float(e >= 2 ? (e - 1) << 23 : 1u << (21 + e));
      }
      return;
    }
    case formats::ScaleType::kNone:
    case formats::ScaleType::kKq45:  // decoded per group by kquant_param
    case formats::ScaleType::kKq6:
    case formats::ScaleType::kKq2:
    case formats::ScaleType::kKiq4:
      break;
  }
  TORCH_CHECK(false, "dense_expert_weight: scales/zeros have no fp32 reading");
}

// How a code q becomes a weight (docs/formats.md, qint).
enum class Affine {
  kSigned,  // 8-bit two's complement: s * q
  kOffset,  // unsigned, implicit zero: s * (q - offset)
  kZeros,   // unsigned with a zeros tensor: s * q - z
  kE2m1,    // mxfp4: q = 2 e2m1(c) + 12, s * (q - 12) = s * 2 e2m1(c)
  kIq4nl,   // iq4_nl, iq4_xs: s * kvalues_iq4nl[c]
};

template <Affine A>
inline float qint_value(int32_t q, float s, float z, int32_t offset) {
  if (A == Affine::kSigned) return s * static_cast<float>(q);
  if (A == Affine::kOffset) return s * static_cast<float>(q - offset);
  if (A == Affine::kZeros) return s * static_cast<float>(q) - z;
  if (A == Affine::kIq4nl) return s * static_cast<float>(formats::iq4nl_value(q));
  // E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 doubled: m = 0..3 as is, m = 4..7
  // -> (4 + 2 (m & 1)) << ((m >> 1) & 1). Masks instead of a table or branches
  // (SSE2 has neither gathers nor per-lane shifts), so the row loop vectorizes.
  const int32_t m = q & 7;
  const int32_t big = -(m >> 2);  // all ones for m >= 4
  const int32_t u = 4 + 2 * (m & 1);
  const int32_t t = (m & ~big) | ((u + (u & -((m >> 1) & 1))) & big);
  const int32_t neg = -((q >> 3) & 1);
  return s * static_cast<float>((t ^ neg) - neg);
}

struct QintExpert {
  const uint8_t* weight;  // the expert's [NB, block_bytes]
  const void* scales;     // the expert's [NB, G, 16]
  const void* zeros;      // likewise, or nullptr
  formats::ScaleType scale_type, zero_type;
  int64_t n, k, kp, groups, group_k;  // group_k: k per group (Kp when one group)
  int64_t ld;                         // row stride of the W^T output
  int64_t ka, kb;                     // the columns of W decoded: [ka, kb), ka % 32 == 0
  int64_t block_bytes, low_bytes;
  int64_t block_param_bytes;  // k-quants: bytes of one block's scale records
  int32_t offset;
};

// Group g's scales s[16] (and zeros z[16] where `zeros`) of row block nb.
void group_params(const QintExpert& x, int64_t nb, int64_t g, bool zeros, float* s, float* z) {
  if (formats::is_kquant(x.scale_type)) {
    // GGUF super-block records: d*sc and dmin*m, exact in fp32.
    const uint8_t* recs = static_cast<const uint8_t*>(x.scales) + nb * x.block_param_bytes;
    for (int r = 0; r < kRows; ++r) {
      s[r] = formats::kquant_param(recs, x.scale_type, g, r, false);
      if (zeros) z[r] = formats::kquant_param(recs, x.scale_type, g, r, true);
    }
    return;
  }
  const int64_t pidx = (nb * x.groups + g) * kRows;
  load_params(x.scales, x.scale_type, pidx, s);
  if (zeros) load_params(x.zeros, x.zero_type, pidx, z);
}

template <int Bits, Affine A>
void decode_qint_transposed(const QintExpert& x, float* wt) {
  const int64_t n = x.n, k = x.kb;
  constexpr int kWordK = 64 * 8 / (kRows * formats::qint_low_plane_bits(Bits));  // k per word
  for (int64_t nb = 0; nb * kRows < n; ++nb) {
    const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
    const uint8_t* block = x.weight + nb * x.block_bytes;
    const uint8_t* high = block + x.low_bytes;
    float* col = wt + nb * kRows;              // W^T row kk - ka
    if ((nb + kPrefetchBlocks) * kRows < n) {  // the words of [ka, k) in that block
      const uint8_t* next = block + kPrefetchBlocks * x.block_bytes;
      prefetch_lines(next + x.ka / kWordK * 64, next + formats::ceil_div(k, kWordK) * 64);
      const int64_t high_k = Bits == 3 || Bits == 5 ? 32 : Bits == 6 ? 16 : 0;  // k per word
      if (high_k > 0) {
        next += x.low_bytes;
        prefetch_lines(next + x.ka / high_k * 64, next + formats::ceil_div(k, high_k) * 64);
      }
    }
    for (int64_t g = 0; g < x.groups; ++g) {
      const int64_t k0 = g * x.group_k;
      if (k0 >= k) break;                    // padding groups, or past kb
      if (k0 + x.group_k <= x.ka) continue;  // before ka
      float s[kRows], z[kRows] = {};
      group_params(x, nb, g, A == Affine::kZeros, s, z);
      const int64_t kend = std::min(k, k0 + x.group_k);
      for (int64_t kw = std::max(k0, x.ka); kw < kend; kw += kWordK) {
        uint32_t lo[kRows];  // one row's 4 bytes per 32-bit lane
        std::memcpy(lo, block + (kw / kWordK) * 64, sizeof(lo));
        if (Bits == 8 && A == Affine::kSigned && rows == kRows && kw + 4 <= k) {
          // Four whole lines: vector extensions (SSE2 in the baseline build), 4 lanes per
          // vector, as the bf16 decoder; the scalar form below ran the int8 LoRA path's panels.
          typedef int32_t Ints __attribute__((vector_size(16)));
          typedef float Floats __attribute__((vector_size(16)));
#pragma GCC unroll 4
          for (int qd = 0; qd < kRows / 4; ++qd) {
            Ints li;
            Floats sv;
            std::memcpy(&li, lo + 4 * qd, sizeof(li));
            std::memcpy(&sv, s + 4 * qd, sizeof(sv));
            for (int j = 0; j < 4; ++j) {
              const Ints q = (li << (24 - 8 * j)) >> 24;
              const Floats v = sv * __builtin_convertvector(q, Floats);
              std::memcpy(col + (kw + j - x.ka) * x.ld + 4 * qd, &v, sizeof(v));
            }
          }
          continue;
        }
        if (Bits == 8) {
          for (int j = 0; j < 4 && kw + j < k; ++j) {
            float line[kRows];
            for (int r = 0; r < kRows; ++r) {
              const int32_t q = static_cast<int32_t>(lo[r] << (24 - 8 * j)) >> 24;
              line[r] = qint_value<A>(q, s[r], z[r], x.offset);
            }
            store_line(line, col + (kw + j - x.ka) * x.ld, rows);
          }
          continue;
        }
        if (Bits <= 3) {
          // 2-bit plane: bits 8 j + 2 c of a row's word are code kw + 4 c + j; 3-bit
          // codes' third bit at 8 j + (kw % 32) / 4 + c of the high plane's word.
          uint32_t hb[kRows] = {};
          const int hshift = static_cast<int>((kw % 32) / 4);
          if (Bits == 3) std::memcpy(hb, high + (kw / 32) * 64, sizeof(hb));
          for (int c = 0; c < 4; ++c) {
            for (int j = 0; j < 4; ++j) {
              const int64_t kk = kw + 4 * c + j;
              if (kk >= k) break;
              float line[kRows];
              for (int r = 0; r < kRows; ++r) {
                int32_t q = static_cast<int32_t>((lo[r] >> (8 * j + 2 * c)) & 3u);
                if (Bits == 3)
                  q |= static_cast<int32_t>(((hb[r] >> (8 * j + hshift + c)) & 1u) << 2);
                line[r] = qint_value<A>(q, s[r], z[r], x.offset);
              }
              store_line(line, col + (kk - x.ka) * x.ld, rows);
            }
          }
          continue;
        }
        uint32_t hi[kRows] = {};
        int hshift = 0;  // where half 0 of this word sits in each high-plane byte
        if (Bits == 5) {
          std::memcpy(hi, high + (kw / 32) * 64, sizeof(hi));
          hshift = static_cast<int>((kw % 32) / 4);
        } else if (Bits == 6) {
          std::memcpy(hi, high + (kw / 16) * 64, sizeof(hi));
          hshift = static_cast<int>(2 * ((kw % 16) / 4));
        }
        for (int half = 0; half < 2; ++half) {
          for (int j = 0; j < 4; ++j) {
            const int64_t kk = kw + 4 * half + j;
            if (kk >= k) break;
            const int lsh = 8 * j + 4 * half;
            const int hsh = 8 * j + hshift + (Bits == 5 ? half : 2 * half);
            float line[kRows];
            for (int r = 0; r < kRows; ++r) {
              int32_t q = static_cast<int32_t>((lo[r] >> lsh) & 15u);
              if (Bits == 5) q |= static_cast<int32_t>(((hi[r] >> hsh) & 1u) << 4);
              if (Bits == 6) q |= static_cast<int32_t>(((hi[r] >> hsh) & 3u) << 4);
              line[r] = qint_value<A>(q, s[r], z[r], x.offset);
            }
            store_line(line, col + (kk - x.ka) * x.ld, rows);
          }
        }
      }
    }
  }
}

formats::ScaleType param_type(const at::Tensor& t, bool e8m0) {
  return formats::scale_type_of(t.scalar_type(), e8m0);
}

// Expert `expert`'s codes and parameters of a qint projection, checked against its
// layout, for columns [ka, kb) written to W^T rows ld apart.
QintExpert qint_expert(const Projection& p, int64_t expert, int64_t ld, int64_t ka, int64_t kb) {
  const formats::QintFormat& f = p.format->qint;
  QintExpert x;
  x.ld = ld;
  x.ka = ka;
  x.kb = kb;
  x.n = p.n;
  x.k = p.k;
  x.kp = formats::qint_k_padded(p.k);
  const int64_t nb = formats::qint_row_blocks(p.n);
  x.groups = formats::qint_groups(p.group_size, x.kp);
  x.group_k = p.group_size == 0 ? x.kp : p.group_size;
  x.block_bytes = formats::qint_block_bytes(f.bits, x.kp);
  x.low_bytes = formats::qint_low_plane_bytes(f.bits, x.kp);
  x.offset = static_cast<int32_t>(f.zero_offset);
  TORCH_CHECK(p.weight.scalar_type() == at::kByte && p.weight.dim() == 3 &&
                  p.weight.size(1) == nb && p.weight.size(2) == x.block_bytes,
              "dense_expert_weight: weight_format='", p.format->name, "' weight must be uint8 [E, ",
              nb, ", ", x.block_bytes, "], got ", p.weight.scalar_type(), " ", p.weight.sizes());
  const bool kquant = formats::is_kquant(p.format->packed_scale_type);
  x.block_param_bytes = 0;
  if (kquant) {
    x.scale_type = p.format->packed_scale_type;
    x.block_param_bytes = formats::qint_block_param_bytes(x.scale_type, x.groups, x.kp, 1);
    TORCH_CHECK(x.kp % formats::kKSuperK == 0 && p.scales.defined() &&
                    p.scales.scalar_type() == at::kByte &&
                    p.scales.numel() == p.num_experts() * nb * x.block_param_bytes,
                "dense_expert_weight: weight_format='", p.format->name,
                "' needs uint8 scale records [E, ", nb, ", ", x.kp / formats::kKSuperK, ", ",
                formats::kquant_record_bytes(x.scale_type), "]");
  } else {
    TORCH_CHECK(p.scales.defined() && p.scales.numel() == p.num_experts() * nb * x.groups * kRows,
                "dense_expert_weight: weight_format='", p.format->name, "' needs scales [E, ", nb,
                ", ", x.groups, ", 16]");
    x.scale_type = param_type(p.scales, p.format->packed_scale_type == formats::ScaleType::kE8M0);
    TORCH_CHECK(x.scale_type != formats::ScaleType::kNone, "dense_expert_weight: scales dtype ",
                p.scales.scalar_type(), " is not fp32/fp16/bf16 (or uint8 UE8M0 for mxfp4)");
  }
  x.weight = p.weight.data_ptr<uint8_t>() + expert * nb * x.block_bytes;
  const int64_t pexp = expert * nb * x.groups * kRows;  // params of one expert
  x.scales = kquant
                 ? static_cast<const void*>(p.scales.data_ptr<uint8_t>() +
                                            expert * nb * x.block_param_bytes)
                 : static_cast<const char*>(p.scales.data_ptr()) + pexp * p.scales.element_size();
  x.zeros = nullptr;
  x.zero_type = formats::ScaleType::kNone;
  if (p.zeros.defined()) {
    TORCH_CHECK(p.zeros.numel() == p.scales.numel(),
                "dense_expert_weight: zeros must have the shape of scales");
    x.zero_type = param_type(p.zeros, false);
    TORCH_CHECK(x.zero_type != formats::ScaleType::kNone, "dense_expert_weight: zeros dtype ",
                p.zeros.scalar_type(), " is not fp32/fp16/bf16");
    x.zeros = static_cast<const char*>(p.zeros.data_ptr()) + pexp * p.zeros.element_size();
  }
  return x;
}

// Whether a qint projection's weights subtract zeros: a zeros tensor, or q4_K / q5_K
// mins in the scale records.
bool qint_has_zeros(const Projection& p) {
  return formats::qint_subtracts_zeros(p.format->packed_scale_type, p.zeros.defined());
}

void dequantize_qint_transposed(const Projection& p, int64_t expert, float* wt, int64_t ld,
                                int64_t ka, int64_t kb) {
  const formats::QintFormat& f = p.format->qint;
  const QintExpert x = qint_expert(p, expert, ld, ka, kb);
  const bool zeros = qint_has_zeros(p);
  switch (f.bits) {
    case 8:
      TORCH_CHECK(f.is_signed && !zeros, "dense_expert_weight: 8-bit codes are signed, no zeros");
      return decode_qint_transposed<8, Affine::kSigned>(x, wt);
    case 4:
      if (f.table == formats::CodeTable::kE2m1)
        return decode_qint_transposed<4, Affine::kE2m1>(x, wt);
      if (f.table == formats::CodeTable::kIq4nl)
        return decode_qint_transposed<4, Affine::kIq4nl>(x, wt);
      return zeros ? decode_qint_transposed<4, Affine::kZeros>(x, wt)
                   : decode_qint_transposed<4, Affine::kOffset>(x, wt);
    case 2:
      return zeros ? decode_qint_transposed<2, Affine::kZeros>(x, wt)
                   : decode_qint_transposed<2, Affine::kOffset>(x, wt);
    case 3:
      return zeros ? decode_qint_transposed<3, Affine::kZeros>(x, wt)
                   : decode_qint_transposed<3, Affine::kOffset>(x, wt);
    case 5:
      return zeros ? decode_qint_transposed<5, Affine::kZeros>(x, wt)
                   : decode_qint_transposed<5, Affine::kOffset>(x, wt);
    case 6:
      return zeros ? decode_qint_transposed<6, Affine::kZeros>(x, wt)
                   : decode_qint_transposed<6, Affine::kOffset>(x, wt);
    default:
      TORCH_CHECK(false, "dense_expert_weight: no decoder for ", f.bits, "-bit codes");
  }
}

// fp8 n16k1 blocks: packed[nb, kk, r] = e4m3 bits of W[16 nb + r, kk], one
// fp32 scale per 128 x 128 (a 16-row block lies inside one 128-row band).
void dequantize_fp8_transposed(const Projection& p, int64_t expert, float* wt, int64_t ld,
                               int64_t ka, int64_t kb) {
  const int64_t n = p.n, k = p.k;
  const int64_t kp = formats::qint_k_padded(k);
  const int64_t nb_count = formats::qint_row_blocks(n);
  const bool rows_scaled = p.format->fp8_row_scales;  // fp8_channel, mxfp8
  const int64_t group_k = p.group_size == 0 ? kp : p.group_size;
  const int64_t sn = rows_scaled ? nb_count : formats::ceil_div(n, formats::kFp8ScaleBlock);
  const int64_t sk =
      rows_scaled ? kp / group_k * kRows : formats::ceil_div(k, formats::kFp8ScaleBlock);
  const formats::ScaleType st = p.format->packed_scale_type;
  const at::ScalarType sdt = st == formats::ScaleType::kE8M0 ? at::kByte : at::kFloat;
  TORCH_CHECK(p.weight.scalar_type() == at::kByte && p.weight.dim() == 4 &&
                  p.weight.size(1) == nb_count && p.weight.size(2) == kp && p.weight.size(3) == 16,
              "dense_expert_weight: weight_format='", p.format->name, "' weight must be uint8 [E, ",
              nb_count, ", ", kp, ", 16], got ", p.weight.scalar_type(), " ", p.weight.sizes());
  TORCH_CHECK(p.scales.defined() && p.scales.scalar_type() == sdt &&
                  p.scales.numel() == p.num_experts() * sn * sk,
              "dense_expert_weight: weight_format='", p.format->name, "' needs ", sdt,
              " scales of ", sn * sk, " values per expert");
  const uint8_t* base = p.weight.data_ptr<uint8_t>() + expert * nb_count * kp * kRows;
  const char* scale_base =
      static_cast<const char*>(p.scales.data_ptr()) + expert * sn * sk * p.scales.element_size();
  for (int64_t nb = 0; nb < nb_count; ++nb) {
    const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
    const uint8_t* block = base + nb * kp * kRows;
    const int64_t band = rows_scaled ? nb : nb * kRows / formats::kFp8ScaleBlock;
    const void* srow = scale_base + band * sk * p.scales.element_size();
    float* col = wt + nb * kRows;           // W^T row kk - ka
    if (nb + kPrefetchBlocks < nb_count) {  // the columns [ka, kb) of that block
      const uint8_t* next = block + kPrefetchBlocks * kp * kRows;
      prefetch_lines(next + ka * kRows, next + kb * kRows);
    }
    for (int64_t kk = ka; kk < kb; ++kk) {
      // Block scales: one per 128 k; row scales: [group][16] (per row below).
      const float scale =
          rows_scaled ? 1.0f : static_cast<const float*>(srow)[kk / formats::kFp8ScaleBlock];
      float rs[kRows];
      for (int r = 0; r < kRows; ++r)
        rs[r] = rows_scaled ? formats::fp8_row_scale(srow, st, (kk / group_k) * kRows + r) : 1.0f;
      const uint8_t* b = block + kk * kRows;
      float line[kRows];
      for (int r = 0; r < kRows; ++r) {
        // Branch-free (masks), so the row loop vectorizes. Normal codes: exponent
        // and mantissa moved under fp32's and re-biased (7 -> 127) in the integer
        // domain (no denormal arithmetic); subnormal codes: m * 2^-9; 0x7F: NaN.
        const uint32_t mag = b[r] & 0x7Fu;
        const uint32_t normal = (mag << 20) + (120u << 23);
        const uint32_t sub =
            float_bits(static_cast<float>(static_cast<int32_t>(mag & 7u)) * 0x1p-9f);
        const uint32_t is_normal = 0u - ((mag + 0x78u) >> 7);  // all ones for mag >= 8
        const uint32_t is_nan = 0u - ((mag + 1u) >> 7);        // all ones for mag == 0x7F
        const uint32_t bits = (normal & is_normal) | (sub & ~is_normal) | (is_nan & 0x7FC00000u) |
                              ((b[r] & 0x80u) << 24);
        line[r] = bits_to_float(bits) * scale * rs[r];
      }
      store_line(line, col + (kk - ka) * ld, rows);
    }
  }
}

// A grid projection (formats/grid.h): columns [ka, kb) of each row decoded to fp32
// (exact: an int8 code times an fp32 scale per 32), written to W^T rows ld apart.
void dequantize_grid_transposed(const Projection& p, int64_t expert, float* wt, int64_t ld,
                                int64_t ka, int64_t kb) {
  const kernels::ProjectionView& v = p.view;
  std::vector<float> row(static_cast<size_t>(kb - ka));
  for (int64_t nb = 0; nb < v.row_blocks; ++nb) {
    const uint8_t* block = v.block(expert, nb);
    const int rows = static_cast<int>(std::min<int64_t>(16, p.n - 16 * nb));
    for (int r = 0; r < rows; ++r) {
      formats::grid_decode_row(v.grid, block, v.kp, r, ka, kb, row.data());
      const int64_t n = 16 * nb + r;
      for (int64_t k = ka; k < kb; ++k) wt[(k - ka) * ld + n] = row[static_cast<size_t>(k - ka)];
    }
  }
}

// Row stride (floats) of the W^T storage. A stride that is a multiple of
// 2 KiB (e.g. n = 2048: 8 KiB) puts the 16-float column strip of a block
// into one cache set for every k and crosses a page on every write: the
// decode of Qwen3's down projection [2048, 768] ran 2x slower than its
// gate [768, 2048]. 16 floats of padding break the pattern.
int64_t dense_ld(int64_t n) { return (n * 4) % 2048 == 0 ? n + 16 : n; }

// Columns [ka, kb) of expert's W into W^T rows 0 .. kb - ka of wt (row stride ld).
void decode_columns(const Projection& p, int64_t expert, int64_t ka, int64_t kb, float* wt,
                    int64_t ld) {
  switch (p.format->layout) {
    case formats::Layout::kBf16:
      return dequantize_bf16_transposed(p, expert, wt, ld, ka, kb);
    case formats::Layout::kFp8:
      return dequantize_fp8_transposed(p, expert, wt, ld, ka, kb);
    case formats::Layout::kQint:
      return dequantize_qint_transposed(p, expert, wt, ld, ka, kb);
    case formats::Layout::kGrid:
      return dequantize_grid_transposed(p, expert, wt, ld, ka, kb);
  }
}

}  // namespace

int64_t dense_expert_weight_numel(const Projection& p) { return p.k * dense_ld(p.n); }

at::Tensor dense_expert_weight(const Projection& p, int64_t expert, const at::Tensor& scratch) {
  TORCH_CHECK(expert >= 0 && expert < p.num_experts(), "dense_expert_weight: expert ", expert,
              " out of range [0, ", p.num_experts(), ")");
  const int64_t ld = dense_ld(p.n);
  const int64_t numel = p.k * ld;
  at::Tensor buf = scratch;
  if (buf.defined()) {
    TORCH_CHECK(buf.scalar_type() == at::kFloat && buf.is_contiguous() && buf.numel() >= numel,
                "dense_expert_weight: scratch must be a contiguous fp32 tensor of at least ", numel,
                " elements (dense_expert_weight_numel)");
  } else {
    buf = at::empty({numel}, at::TensorOptions().dtype(at::kFloat));
  }
  decode_columns(p, expert, 0, p.k, buf.data_ptr<float>(), ld);
  // Every decoder writes W^T: [k, ld] row-major storage, seen as W [n, k] with strides
  // (1, ld); the BLAS takes ld as the leading dimension (no copy).
  return buf.as_strided({p.n, p.k}, {1, ld});
}

int64_t dense_panel_ld(const Projection& p) { return dense_ld(p.n); }

bool fp8_block_scaled(const Projection& p) {
  return p.format->layout == formats::Layout::kFp8 && !p.format->fp8_row_scales;
}

namespace {

// fp8_channel: one fp32 scale per output row, as int8's.
bool is_fp8_channel(const Projection& p) {
  return p.format->layout == formats::Layout::kFp8 && p.format->fp8_row_scales &&
         p.format->default_group_size == 0;
}
// mxfp8: a UE8M0 exponent per row and 32 k, moved into the decoded bf16 values.
bool is_mxfp8(const Projection& p) {
  return p.format->layout == formats::Layout::kFp8 &&
         p.format->packed_scale_type == formats::ScaleType::kE8M0;
}

// mxfp4: E2M1 codes with a UE8M0 scale 2^(E-128) per row and 32 k. Its values
// s * 2 e2m1(c), 2 e2m1(c) in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12} (at most two
// significant bits), are bf16 values while they stay normal: E in [2, 252]
// (12 * 2^124 < bf16's largest finite value; 2^(2-128) its smallest normal). Outside,
// panel_values_exact says no (as for mxfp8).
bool is_mxfp4(const Projection& p) { return kernels::brgemm::mxfp4_applies(*p.format); }
using kernels::avx512::kMxfp4BfMaxE;
using kernels::avx512::kMxfp4BfMinE;

}  // namespace

bool backward_panels_format(const Projection& p) {
  const bool bf16 = p.format->layout == formats::Layout::kBf16;
  const bool int8 = kernels::brgemm::int8_per_channel_applies(*p.format) && !p.zeros.defined();
  const bool fp8 = fp8_block_scaled(p) || is_fp8_channel(p) || is_mxfp8(p);
  return (bf16 || int8 || fp8 || is_mxfp4(p)) && p.n % 16 == 0 && p.k % 16 == 0;
}

bool bf16_vnni_panel_applies(const Projection& p) {
  // mxfp4: the split decoder's hi part alone (split_vnni_panel), which is its values.
  const bool decoder = p.format->layout == formats::Layout::kBf16 ? true
                       : is_mxfp4(p)
                           ? split_vnni_panel_applies(p) && kernels::avx512::e8m0_within != nullptr
                       : p.format->layout == formats::Layout::kFp8
                           ? kernels::avx512::fp8_to_bf16_vnni != nullptr &&
                                 kernels::avx512::fp8_e8m0_fits_bf16 != nullptr
                           : kernels::avx512::int8_to_bf16_vnni != nullptr;
  return backward_panels_format(p) && decoder &&
         kernels::avx512::bf16_vnni_panel_block != nullptr && runtime::cpu_features().avx512;
}

const float* fp8_chunk_scales(const Projection& p, int64_t expert, int64_t k0) {
  if (!fp8_block_scaled(p)) return nullptr;
  thread_local std::vector<float> t_scales;
  const int64_t bands = p.scales.size(1), kblocks = p.scales.size(2);  // [E][n/128][k/128]
  if (t_scales.size() < static_cast<size_t>(bands)) t_scales.resize(static_cast<size_t>(bands));
  const float* s = p.scales.data_ptr<float>() + expert * bands * kblocks + k0 / 128;
  for (int64_t b = 0; b < bands; ++b) t_scales[b] = s[b * kblocks];
  return t_scales.data();
}

bool panel_values_exact(const Projection& p, int64_t expert) {
  const bool mxfp4 = is_mxfp4(p);
  if (!is_mxfp8(p) && !mxfp4) return true;
  const int64_t blocks = formats::ceil_div(p.n, int64_t{16}), groups = p.scales.size(2);
  const auto* e = static_cast<const uint8_t*>(p.scales.data_ptr()) +
                  expert * blocks * groups * 16;  // [E][NB][G][16]
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const int rows = static_cast<int>(std::min<int64_t>(16, p.n - 16 * nb));
    const uint8_t* be = e + nb * groups * 16;
    if (mxfp4 ? !kernels::avx512::e8m0_within(be, groups, rows, kMxfp4BfMinE, kMxfp4BfMaxE)
              : !kernels::avx512::fp8_e8m0_fits_bf16(be, groups, rows))
      return false;
  }
  return true;
}

const float* channel_scales(const Projection& p, int64_t expert) {
  if (p.format->layout == formats::Layout::kBf16 || fp8_block_scaled(p) || is_mxfp8(p) ||
      is_mxfp4(p))
    return nullptr;
  thread_local std::vector<float> t_scales;
  if (t_scales.size() < static_cast<size_t>(p.n)) t_scales.resize(static_cast<size_t>(p.n));
  const int64_t blocks = formats::ceil_div(p.n, int64_t{16});
  const formats::ScaleType type = formats::scale_type_of(p.scales.scalar_type());
  const auto* base = static_cast<const uint8_t*>(p.scales.data_ptr()) +
                     expert * blocks * 16 * p.scales.element_size();  // [E][NB][1][16]
  for (int64_t r = 0; r < p.n; ++r) t_scales[r] = formats::scale_value(base, type, r);
  return t_scales.data();
}

namespace {

// Expert `expert`'s first 16-row block of a bf16, int8 or fp8 projection and the bytes
// from one block to the next (bf16: [k/2][16][2]; int8: [Kp/4][16][4] codes; fp8:
// [Kp][16] codes).
std::pair<const uint8_t*, int64_t> expert_blocks(const Projection& p, int64_t expert) {
  const formats::Layout layout = p.format->layout;
  const int64_t block_bytes = layout == formats::Layout::kBf16 ? formats::bf16_block_elems(p.k) * 2
                              : layout == formats::Layout::kFp8
                                  ? p.weight.size(2) * 16  // [E][NB][Kp][16]
                                  : p.weight.size(-1);     // [E][NB][Kp * 16]
  return {static_cast<const uint8_t*>(p.weight.data_ptr()) +
              expert * (p.n / formats::kBf16BlockRows) * block_bytes,
          block_bytes};
}

}  // namespace

void bf16_vnni_panel(const Projection& p, int64_t expert, int64_t k0, int64_t cols, uint16_t* dst) {
  TORCH_CHECK(bf16_vnni_panel_applies(p) && expert >= 0 && expert < p.num_experts() &&
                  k0 % 16 == 0 && cols % 16 == 0 && k0 >= 0 && k0 + cols <= p.k,
              "bf16_vnni_panel: columns [", k0, ", ", k0 + cols, ") of a ", p.n, " x ", p.k, " ",
              p.format->name, " projection (or no AVX-512 here)");
  constexpr int kRows = formats::kBf16BlockRows;
  const int64_t blocks = p.n / kRows;
  if (is_mxfp4(p)) {  // its values are the split decoder's hi part (is_mxfp4)
    split_vnni_panel(p, expert, k0, cols, dst, nullptr);
    return;
  }
  const auto [base, block_bytes] = expert_blocks(p, expert);
  if (p.format->layout != formats::Layout::kBf16) {
    // int8, fp8: the block's codes of columns [k0, k0 + cols) decoded to their exact bf16
    // values ([cols/2][16][2], a bf16 block of that width), then the same panel.
    thread_local std::vector<uint16_t> t_block;
    if (t_block.size() < static_cast<size_t>(cols * kRows))
      t_block.resize(static_cast<size_t>(cols * kRows));
    const bool fp8 = p.format->layout == formats::Layout::kFp8;
    // mxfp8: decoded from the start of the exponents' 32-k group holding k0.
    const int64_t lead = is_mxfp8(p) ? k0 % formats::kMxfp8GroupK : 0;
    const int64_t groups = is_mxfp8(p) ? p.scales.size(2) : 0;
    if (t_block.size() < static_cast<size_t>((cols + lead) * kRows))
      t_block.resize(static_cast<size_t>((cols + lead) * kRows));
    for (int64_t nb = 0; nb < blocks; ++nb) {
      const uint8_t* codes = base + nb * block_bytes + (k0 - lead) * kRows;  // int8 [k/4][16][4]
      if (fp8) {                                                             // fp8 [k][16]
        const uint8_t* e8m0 =
            groups == 0 ? nullptr
                        : static_cast<const uint8_t*>(p.scales.data_ptr()) +
                              ((expert * blocks + nb) * groups + k0 / formats::kMxfp8GroupK) * 16;
        kernels::avx512::fp8_to_bf16_vnni(codes, cols + lead, t_block.data(), kRows, nullptr, true,
                                          e8m0);
      } else {
        kernels::avx512::int8_to_bf16_vnni(codes, cols, t_block.data());
      }
      kernels::avx512::bf16_vnni_panel_block(t_block.data(), lead / 2, cols,
                                             dst + nb * (kRows / 2) * cols * 2);
    }
    return;
  }
  for (int64_t nb = 0; nb < blocks; ++nb)  // row pairs 8 nb .. 8 nb + 7
    kernels::avx512::bf16_vnni_panel_block(
        reinterpret_cast<const uint16_t*>(base + nb * block_bytes), k0 / 2, cols,
        dst + nb * (kRows / 2) * cols * 2);
}

kernels::PrefetchChunks vnni_panel_source(const Projection& p, int64_t expert, int64_t k0,
                                          int64_t cols) {
  kernels::PrefetchChunks src;
  if (p.format->layout == formats::Layout::kGrid) return src;  // its records: not prefetched
  const auto [base, block_bytes] = expert_blocks(p, expert);
  const bool bf16 = p.format->layout == formats::Layout::kBf16;
  // Codes of under 8 bits: their low plane, 8 k of 16 rows per line (a 5- or 6-bit
  // format's high plane and the scales are not prefetched: a fraction of the bytes).
  const bool nibbles = p.format->layout == formats::Layout::kQint && p.format->qint.bits < 8;
  // 16 columns of a block: bf16 8 lines from k pair k0 / 2 (a pair of 16 rows per line),
  // int8 4 lines from k quad k0 / 4 (a quad of 16 rows per line), fp8 4 lines from k0
  // (4 k of 16 rows per line), 4-bit codes 2 lines from k0 / 8; cols / 16 times as many.
  int log2_cols = 0;
  while ((int64_t{16} << log2_cols) < cols) ++log2_cols;
  src.base = base + (bf16 ? k0 / 2 * 64 : nibbles ? k0 / 8 * 64 : k0 * formats::kBf16BlockRows);
  src.stride = block_bytes;
  src.chunk_lines_log2 = (bf16 ? 3 : nibbles ? 1 : 2) + log2_cols;
  src.lines = (p.n / formats::kBf16BlockRows) << src.chunk_lines_log2;
  return src;
}

namespace {

// How a qint projection's codes reach kernels::avx512::qint_block_vnni_split.
kernels::avx512::QintValue qint_value_form(const Projection& p) {
  using kernels::avx512::QintValue;
  const formats::QintFormat& f = p.format->qint;
  const bool zeros = qint_has_zeros(p);
  if (f.bits == 8) return QintValue::kSigned;
  if (f.table == formats::CodeTable::kE2m1) return QintValue::kE2m1;
  if (f.table == formats::CodeTable::kIq4nl) return QintValue::kIq4nl;
  return zeros ? QintValue::kZeros : QintValue::kOffset;
}

// group_params with the fp32 / fp16 / bf16 scales and zeros converted 16 at a time (the
// scalar fp16 conversion was 5% of an int4 LoRA step at T = 512); E8M0 keeps the
// reference's exact subnormal scales, which the vector load flushes.
void group_params_fast(const QintExpert& x, int64_t nb, int64_t g, bool zeros, float* s, float* z) {
  const auto vector = [](formats::ScaleType t) {
    return t == formats::ScaleType::kF32 || t == formats::ScaleType::kF16 ||
           t == formats::ScaleType::kBF16;
  };
  if (!vector(x.scale_type) || (zeros && !vector(x.zero_type)))
    return group_params(x, nb, g, zeros, s, z);
  const int64_t pidx = (nb * x.groups + g) * kRows;
  kernels::avx512::qint_params16(x.scales, x.scale_type, pidx, s);
  if (zeros) kernels::avx512::qint_params16(x.zeros, x.zero_type, pidx, z);
}

}  // namespace

bool split_vnni_panel_applies(const Projection& p) {
  // Every qint format (8-bit codes are signed, never with zeros; int8 per channel takes
  // the exact panels first), groups of a multiple of 16 k (per channel: Kp) so that 16
  // columns share one.
  const int64_t group_k = p.group_size == 0 ? formats::qint_k_padded(p.k) : p.group_size;
  const bool zeros = qint_has_zeros(p);
  return p.format->layout == formats::Layout::kQint && p.n % 16 == 0 && p.k % 16 == 0 &&
         group_k % 16 == 0 && !(p.format->qint.bits == 8 && zeros) &&
         kernels::avx512::qint_block_vnni_split != nullptr &&
         kernels::avx512::kquant_record_params != nullptr &&
         kernels::avx512::qint_params16 != nullptr &&
         kernels::avx512::bf16_vnni_panel_block != nullptr && runtime::cpu_features().avx512 &&
         runtime::cpu_features().avx512_bf16;  // the decoder's rounding
}

// The AVX-512 decoder writes the panel's row pairs straight from the codes
// (kernels::avx512::qint_block_vnni_split: the dense decoder's values, 16 rows per
// register), k-quant records decoded 16 rows at once (kquant_record_params).
void split_vnni_panel(const Projection& p, int64_t expert, int64_t k0, int64_t cols, uint16_t* hi,
                      uint16_t* lo, int64_t slice_width) {
  const int64_t width = slice_width == 0 ? cols : slice_width;
  TORCH_CHECK(split_vnni_panel_applies(p) && expert >= 0 && expert < p.num_experts() &&
                  k0 % 16 == 0 && cols % 16 == 0 && k0 >= 0 && k0 + cols <= p.k &&
                  width % 16 == 0 && width > 0 && cols % width == 0,
              "split_vnni_panel: columns [", k0, ", ", k0 + cols, ") in slices of ", width,
              " of a ", p.n, " x ", p.k, " ", p.format->name, " projection (or no AVX-512 here)");
  const kernels::avx512::PanelSlices out{width, p.n * width};
  const QintExpert x = qint_expert(p, expert, 0, k0, k0 + cols);
  const kernels::avx512::QintValue value = qint_value_form(p);
  const bool zeros = value == kernels::avx512::QintValue::kZeros;
  const bool kquant = formats::is_kquant(x.scale_type);
  const int64_t slices = cols / 16;
  // Per 16 columns, the 16 rows' scales (and zeros); a k-quant super-block's records.
  thread_local std::vector<float> t_params;
  if (t_params.size() < static_cast<size_t>(2 * slices * kRows + 2 * 16 * kRows))
    t_params.resize(static_cast<size_t>(2 * slices * kRows + 2 * 16 * kRows));
  float* s = t_params.data();
  float* z = s + slices * kRows;
  float* rs = z + slices * kRows;  // [16][16] of one record
  float* rz = rs + 16 * kRows;
  const int64_t record_bytes = kquant ? formats::kquant_record_bytes(x.scale_type) : 0;
  const int64_t super_k = kquant ? x.group_k * formats::kquant_sub_blocks(x.scale_type) : 0;
  // The codes' lines of the columns (low plane, and the high plane's, one per 32 / 16 k,
  // of 5/6-bit codes), fetched kPrefetchBlocks row blocks ahead: the product's prefetch
  // of the next panel (vnni_panel_source) covers the low plane only, and for 5/6-bit
  // codes the decode still waited on memory (a q6_k backward at T = 512: 446 -> 298 ms;
  // int4, q4_k unchanged).
  constexpr int64_t kPrefetchBlocks = 4;
  const int bits = p.format->qint.bits;
  const int64_t high_k = bits == 3 || bits == 5 ? 32 : bits == 6 ? 16 : 0;
  const int64_t kWordK = 64 * 8 / (kRows * formats::qint_low_plane_bits(bits));  // k per line
  for (int64_t nb = 0; nb < p.n / kRows; ++nb) {
    const uint8_t* block = x.weight + nb * x.block_bytes;
    if (nb + kPrefetchBlocks < p.n / kRows) {
      const uint8_t* ahead = block + kPrefetchBlocks * x.block_bytes;
      for (int64_t kk = k0 - (high_k > 0 ? k0 % high_k : 0); high_k > 0 && kk < k0 + cols;
           kk += high_k)
        __builtin_prefetch(ahead + x.low_bytes + kk / high_k * 64);
      for (int64_t kk = k0; kk < k0 + cols; kk += kWordK)
        __builtin_prefetch(ahead + kk / kWordK * 64);
    }
    int64_t group = -1, record = -1;
    for (int64_t c = 0; c < slices; ++c) {
      const int64_t kc = k0 + 16 * c, g = kc / x.group_k;
      if (kquant) {
        if (kc / super_k != record) {
          record = kc / super_k;
          kernels::avx512::kquant_record_params(static_cast<const uint8_t*>(x.scales) +
                                                    nb * x.block_param_bytes +
                                                    record * record_bytes,
                                                x.scale_type, rs, rz);
        }
        const int64_t j = (kc % super_k) / x.group_k;
        std::memcpy(s + c * kRows, rs + j * kRows, kRows * sizeof(float));
        std::memcpy(z + c * kRows, rz + j * kRows, kRows * sizeof(float));
        continue;
      }
      if (g != group) {
        group_params_fast(x, nb, g, zeros, s + c * kRows, z + c * kRows);
      } else {  // the previous 16 columns' group
        std::memcpy(s + c * kRows, s + (c - 1) * kRows, kRows * sizeof(float));
        std::memcpy(z + c * kRows, z + (c - 1) * kRows, kRows * sizeof(float));
      }
      group = g;
    }
    const int64_t at = nb * (kRows / 2) * width * 2;  // row pairs 8 nb .. 8 nb + 7
    const bool done = kernels::avx512::qint_block_vnni_split(
        block, block + x.low_bytes, bits, value, x.offset, k0, cols, s, z, out, hi + at,
        lo == nullptr ? nullptr : lo + at);
    TORCH_INTERNAL_ASSERT(done, "split_vnni_panel: no decoder for ", p.format->name);
  }
}

void dense_expert_panel(const Projection& p, int64_t expert, int64_t k0, int64_t k1, float* panel) {
  TORCH_CHECK(
      expert >= 0 && expert < p.num_experts() && k0 % 32 == 0 && 0 <= k0 && k0 < k1 && k1 <= p.k,
      "dense_expert_panel: expert ", expert, " columns [", k0, ", ", k1,
      ") outside the projection or not 32-aligned");
  decode_columns(p, expert, k0, k1, panel, dense_ld(p.n));
}

}  // namespace kt::moe
