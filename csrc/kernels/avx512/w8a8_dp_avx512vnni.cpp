// The w8a8 tile kernel for AVX512_VNNI CPUs without AMX: the product of the
// w8a8 brgemm path (kernels/brgemm.h: int8 weights with one scale per output
// channel, activations quantized per token), written with vpdpbusd, as
// avx512_bf16/bf16_dp is for bf16. oneDNN's u8s8 brgemm leaves the weight
// stream to the hardware prefetchers and takes u8 activations, so each token
// quad is a separate broadcast; here the roles swap: the weights are the
// unsigned operand (code ^ 0x80 = code + 128, one vpxord per 64-byte line and
// tile) and each token's signed quad is broadcast straight from memory into
// vpdpbusd (its {1to16} operand). The + 128 comes back as 128 * sum q per
// token and K chunk, computed once when the rows are packed:
//   acc = -128 sum q + sum (w + 128) q = sum w q   (exact modulo 2^32)
// then out = float(acc) * (sw * sx) (+ out for the chunks after the first):
// the same exact int32 sums and the same epilogue operations as
// onednn/brgemm_w8a8 (avx512::w8a8_epilogue), so the two are bit-identical.
//
// REGISTER PLAN  a tile is MT <= 28 token rows x 16 weight rows: MT zmm int32
//   accumulators, the converted weight line and the 0x80 constant. The A
//   operand is packed per tile, [kp/4][mt][4] signed quads (one pointer, the
//   rows at fixed offsets; row pointers would not fit the general registers).
//   m rows are cut into near-equal tiles (kernels/row_tiles.h); the first tile
//   streams the block from DRAM with a software prefetch kPrefetchLines ahead,
//   the others find it in L2.
//
// Compiled in the avx512 tier with a function-level target (avx512vnni): a tile
// kernel of the tier table (kernels/dispatch.cpp), which the plan runs only where
// brgemm::kt_w8a8_runs() (AVX512_VNNI) holds.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels/avx512/vec.h"
#include "kernels/brgemm.h"
#include "kernels/row_tiles.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

#define KT_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

constexpr int kMaxTileRows = brgemm::kW8A8TileRows;
// Weight lines (64 bytes, one k quad) ahead of the first tile's loads: 2 KB.
constexpr int kPrefetchLines = 32;

// Tile of MT rows over the quads [q0, q1) of one 16-row block w [kp/4][16][4];
// a: the tile's packed quads [kp/4][MT][4]; init[i * init_ld]: -128 * the row's sum
// of q over the chunk; out[i * ldo + r] = (accumulate ? out : 0) + acc * sw * sx[i].
template <int MT, bool Prefetch>
KT_VNNI_TARGET void w8a8_tile(const uint8_t* a, const uint8_t* w, int64_t q0, int64_t q1,
                              const int32_t* init, int64_t init_ld, const float* sx, __m512 sw,
                              bool accumulate, float* out, int64_t ldo) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[MT];
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_set1_epi32(init[i * init_ld]);
  for (int64_t q = q0; q < q1; ++q) {
    if constexpr (Prefetch) __builtin_prefetch(w + 64 * (q + kPrefetchLines));
    const __m512i wl = _mm512_xor_si512(_mm512_loadu_si512(w + 64 * q), flip);
    const uint8_t* aq = a + q * (4 * MT);
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) dpbusd_bcast(acc[i], wl, aq + 4 * i);
  }
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) {
    const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(sx[i]));
    float* o = out + i * ldo;
    const __m512 base = accumulate ? _mm512_loadu_ps(o) : _mm512_setzero_ps();
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), s, base));
  }
}

// w8a8_tile<rows, Prefetch> for rows in [1, N], picked at run time.
template <int N, bool Prefetch>
KT_VNNI_TARGET void w8a8_tile_n(int rows, const uint8_t* a, const uint8_t* w, int64_t q0,
                                int64_t q1, const int32_t* init, int64_t init_ld, const float* sx,
                                __m512 sw, bool accumulate, float* out, int64_t ldo) {
  if constexpr (N >= 1) {
    if (rows == N)
      return w8a8_tile<N, Prefetch>(a, w, q0, q1, init, init_ld, sx, sw, accumulate, out, ldo);
    return w8a8_tile_n<N - 1, Prefetch>(rows, a, w, q0, q1, init, init_ld, sx, sw, accumulate, out,
                                        ldo);
  }
}

KT_VNNI_TARGET void w8a8_dp_dot_impl(const DotArgs& a, const uint8_t* packed) {
  const ProjectionView& p = *a.proj;
  const int64_t kp = p.kp, chunks = brgemm::w8a8_dp_chunks(kp);
  const auto* sx = reinterpret_cast<const float*>(packed);
  const auto* init = reinterpret_cast<const int32_t*>(packed + brgemm::w8a8_scale_bytes(a.m));
  const uint8_t* tiles = packed + brgemm::w8a8_dp_header_bytes(a.m, kp);
  using V = QintVec512<false>;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const QintBlock blk = qint_block(a, nb);
    const __m512 sw = V::load_scales(blk.scales, p.qint.scale_type, 0);  // per channel
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t q0 = c * (brgemm::kW8A8MaxK / 4);
      const int64_t q1 = std::min(kp, (c + 1) * brgemm::kW8A8MaxK) / 4;
      for_each_row_tile(a.m, kMaxTileRows, [&](int t, int i, int rows) {
        const uint8_t* at = tiles + static_cast<int64_t>(i) * kp;
        float* o = blk.out + i * blk.ldo;
        const int32_t* in = init + static_cast<int64_t>(i) * chunks + c;
        if (t == 0) {
          w8a8_tile_n<kMaxTileRows, true>(rows, at, blk.block, q0, q1, in, chunks, sx + i, sw,
                                          c > 0, o, blk.ldo);
        } else {
          w8a8_tile_n<kMaxTileRows, false>(rows, at, blk.block, q0, q1, in, chunks, sx + i, sw,
                                           c > 0, o, blk.ldo);
        }
      });
    }
  }
}

// ---------------------------------------------------------------------------
// int4 per output channel (w4a8; kt-kernel AMXINT4's scheme): unsigned 4-bit codes
// c, w = s * (c - 8) (implicit zero) or s * c - zero (explicit), one scale (and zero)
// per output channel. The codes are vpdpbusd's unsigned operand as they are (low
// plane [kp/8][16][4]: line l holds quad 2l in the low nibbles, 2l+1 in the high
// ones); the int32 sum over all of K of c q is exact (|c q| <= 15 * 127), then
//   implicit: acc starts at -8 sum q:  out = s * (sx * float(acc))
//   explicit:                          out = s * (sx * float(acc)) - zero * (sx * sum q)
// with sum q from the packed rows' per-32 sums. Per channel only
// (brgemm::w4a8_applies_to): with groups, the per-group fold into fp32 sums kept in
// L1 cost more than the streaming kernel's (Zen 4, 8 experts x 128 tokens: g128
// 21.0 against 21.2 ms, g32 34.3 against 21.0; per channel 16.4 against 22.0), and
// with them in registers (sub-tiles of 12 rows) g128 gained 1.10x, g64 lost (21.9
// against 21.1), g32 lost 1.45x: not worth the coarser activation rounding.
// ---------------------------------------------------------------------------

template <int MT, bool Prefetch>
KT_VNNI_TARGET void w4a8_tile(const uint8_t* a, const QintBlock& blk, const int32_t* sums,
                              int64_t units, const float* sx, float* out, int64_t ldo) {
  const formats::QintFormat& f = *blk.format;
  using V = QintVec512<false>;
  const bool explicit_zero = blk.zeros != nullptr;
  int32_t sq[MT];  // sum of q over K per row
  for (int i = 0; i < MT; ++i) {
    int32_t t = 0;
    for (int64_t u = 0; u < units; ++u) t += sums[i * units + u];
    sq[i] = t;
  }
  __m512i acc[MT];
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_set1_epi32(explicit_zero ? 0 : -8 * sq[i]);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const uint8_t* w = blk.block;
  for (int64_t l = 0; l < blk.kp / 8; ++l) {
    if constexpr (Prefetch) __builtin_prefetch(w + 64 * (l + kPrefetchLines));
    const __m512i raw = _mm512_loadu_si512(w + 64 * l);
    const __m512i lo = _mm512_and_si512(raw, mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    const uint8_t* aq = a + l * (8 * MT);  // quads 2l, 2l + 1
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) dpbusd_bcast(acc[i], lo, aq + 4 * i);
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) dpbusd_bcast(acc[i], hi, aq + 4 * MT + 4 * i);
  }
  const __m512 s = V::load_scales(blk.scales, f.scale_type, 0);
  const __m512 z = explicit_zero ? V::load_scales(blk.zeros, f.zero_type, 0) : _mm512_setzero_ps();
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) {
    const __m512 xa = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(sx[i]));
    __m512 r = _mm512_mul_ps(s, xa);
    if (explicit_zero) r = _mm512_fnmadd_ps(z, _mm512_set1_ps(sx[i] * sq[i]), r);
    _mm512_storeu_ps(out + i * ldo, r);
  }
}

template <int N, bool Prefetch>
KT_VNNI_TARGET void w4a8_tile_n(int rows, const uint8_t* a, const QintBlock& blk,
                                const int32_t* sums, int64_t units, const float* sx, float* out,
                                int64_t ldo) {
  if constexpr (N >= 1) {
    if (rows == N) return w4a8_tile<N, Prefetch>(a, blk, sums, units, sx, out, ldo);
    return w4a8_tile_n<N - 1, Prefetch>(rows, a, blk, sums, units, sx, out, ldo);
  }
}

KT_VNNI_TARGET void w4a8_dp_dot_impl(const DotArgs& a, const uint8_t* packed) {
  const int64_t kp = a.proj->kp, units = kp / 32;
  const auto* sx = reinterpret_cast<const float*>(packed);
  const auto* sums = reinterpret_cast<const int32_t*>(packed + brgemm::w8a8_scale_bytes(a.m));
  const uint8_t* tiles = packed + brgemm::w4a8_dp_header_bytes(a.m, kp);
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const QintBlock blk = qint_block(a, nb);
    for_each_row_tile(a.m, kMaxTileRows, [&](int t, int i, int rows) {
      const uint8_t* at = tiles + static_cast<int64_t>(i) * kp;
      const int32_t* si = sums + static_cast<int64_t>(i) * units;
      float* o = blk.out + i * blk.ldo;
      if (t == 0) {
        w4a8_tile_n<kMaxTileRows, true>(rows, at, blk, si, units, sx + i, o, blk.ldo);
      } else {
        w4a8_tile_n<kMaxTileRows, false>(rows, at, blk, si, units, sx + i, o, blk.ldo);
      }
    });
  }
}

// Sum of the signed codes of one row's u8 codes (q + 128) over n bytes (n a multiple of 4).
KT_VNNI_TARGET int32_t sum_q(const uint8_t* u8, int64_t n) {
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 64 <= n; j += 64)
    acc =
        _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_loadu_si512(u8 + j), _mm512_setzero_si512()));
  int64_t s = _mm512_reduce_add_epi64(acc);
  for (; j < n; ++j) s += u8[j];
  return static_cast<int32_t>(s - 128 * n);
}

}  // namespace

// Plain entry points (a target-attributed declaration would be a GCC function
// version): tiers.h declares them weak.
void w8a8_dp_dot(const DotArgs& a, const TileOperand& op) {
  w8a8_dp_dot_impl(a, static_cast<const uint8_t*>(op.rows));
}

void w4a8_dp_dot(const DotArgs& a, const TileOperand& op) {
  w4a8_dp_dot_impl(a, static_cast<const uint8_t*>(op.rows));
}

namespace {

// One thread's byte buffer for a token row, grown on demand. Not a std::vector:
// its out-of-line members (_M_default_append) would be a weak symbol that this
// AVX-512 object shares with the baseline objects, and the linker may keep this
// copy for every caller, AVX2 hosts included (cmake/check_isa_odr.py).
class RowBuffer {
 public:
  ~RowBuffer() { std::free(data_); }
  uint8_t* reserve(size_t n) {
    if (n > size_) {
      void* p = std::realloc(data_, n);
      if (p == nullptr) throw std::bad_alloc();
      data_ = static_cast<uint8_t*>(p);
      size_ = n;
    }
    return data_;
  }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The per-token rows of both kernels' A operands: row i's scale at scales[i], its
// signed codes in the near-equal tiles at `tiles` ([kp/4][mt][4] per tile), and
// row_sums(i, row) with its codes + 128 (kp bytes) for the kernel's sums of q.
template <class RowSums>
void pack_token_rows(const float* const* x, int m, int64_t kp, float* scales, uint8_t* tiles,
                     RowSums row_sums) {
  thread_local RowBuffer t_row;
  uint8_t* row = t_row.reserve(static_cast<size_t>(kp));
  for_each_row_tile(m, kMaxTileRows, [&](int, int i0, int mt) {
    uint8_t* tile = tiles + static_cast<int64_t>(i0) * kp;
    for (int r = 0; r < mt; ++r) {
      const int i = i0 + r;
      quantize_rows_i8_token(x + i, 1, kp, row, kp, scales + i);  // q + 128
      row_sums(i, row);
      for (int64_t q = 0; q < kp / 4; ++q) {
        uint32_t quad;
        std::memcpy(&quad, row + 4 * q, sizeof(quad));
        quad ^= 0x80808080u;  // q + 128 -> q as a signed byte
        std::memcpy(tile + (q * mt + r) * 4, &quad, sizeof(quad));
      }
    }
  });
}

}  // namespace

void pack_w4a8_dp_rows(const float* const* x, int m, int64_t kp, uint8_t* dst) {
  auto* sums = reinterpret_cast<int32_t*>(dst + brgemm::w8a8_scale_bytes(m));
  const int64_t units = kp / 32;
  pack_token_rows(x, m, kp, reinterpret_cast<float*>(dst),
                  dst + brgemm::w4a8_dp_header_bytes(m, kp), [&](int i, const uint8_t* row) {
                    for (int64_t u = 0; u < units; ++u)
                      sums[static_cast<int64_t>(i) * units + u] = sum_q(row + 32 * u, 32);
                  });
}

void pack_w8a8_dp_rows(const float* const* x, int m, int64_t kp, uint8_t* dst) {
  auto* init = reinterpret_cast<int32_t*>(dst + brgemm::w8a8_scale_bytes(m));
  const int64_t chunks = brgemm::w8a8_dp_chunks(kp);
  pack_token_rows(x, m, kp, reinterpret_cast<float*>(dst),
                  dst + brgemm::w8a8_dp_header_bytes(m, kp), [&](int i, const uint8_t* row) {
                    for (int64_t c = 0; c < chunks; ++c) {
                      const int64_t k0 = c * brgemm::kW8A8MaxK;
                      const int64_t k1 = std::min(kp, k0 + brgemm::kW8A8MaxK);
                      init[static_cast<int64_t>(i) * chunks + c] = static_cast<int32_t>(
                          -128 * static_cast<int64_t>(sum_q(row + k0, k1 - k0)));
                    }
                  });
}

}  // namespace kt::kernels::avx512
