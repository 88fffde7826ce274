// The "qint" weight-format family: integer codes with grouped affine
// dequantization, W[n,k] = scale[n,g] * q[n,k] - zero[n,g]. Formats int8,
// int4, mxfp4, nvfp4, q8_0, q4_0, q2_k ... q6_k, iq4_nl, iq4_xs are all members (docs/formats.md
// has the byte layout and the table of members; this header is its C++
// mirror and the scalar reference decoder the kernels are tested against).
#pragma once

#include <cstdint>
#include <cstring>

namespace kt::formats {

constexpr int kQintBlockRows = 16;  // output rows per block
constexpr int kQintKAlign = 32;     // K is padded to a multiple of this

// How scales / zeros are stored (one value per 16-row block row and group),
// or, for the GGUF k-quants, one record per 16-row block and super-block of
// 256 k that holds GGUF's own two-level scales (kKq45: q4_K / q5_K, kKq6:
// q6_K and q3_K, kKq2: q2_K, kKiq4: IQ4_XS; layout below), decoded by the kernels.
enum class ScaleType : uint8_t { kNone, kF32, kF16, kBF16, kE8M0, kKq45, kKq6, kKq2, kKiq4 };

// ---- GGUF k-quant super-block records (docs/formats.md, "k-quant scales") ---
//
// One record per (16-row block, super-block of 256 k), the block's 16 rows
// side by side (row r = lane r), bytes exactly as GGUF stores them per row:
//   kKq45 (q4_K, q5_K), 256 bytes: d fp16 [16] | dmin fp16 [16] |
//         scales[12][16] (byte i of GGUF's `scales[12]` of row r at 64 + 16 i + r);
//         sub-block j (32 k) has the 6-bit scale sc_j and min m_j of
//         get_scale_min_k4, W = d*sc_j * q - dmin*m_j.
//   kKq6 (q6_K), 288 bytes: d fp16 [16] | int8 scales[16][16] (sub-block j of
//         16 k of row r at 32 + 16 j + r); W = d*sc_j * (q - 32). q3_K's
//         records are the same bytes: its 6-bit scales unpacked to int8
//         sc_j - 32 when the blocks are repacked (lossless), its 3-bit codes
//         q + 4 (bits 0-1 in the 2-bit plane, bit 2 in the high plane), W = d*sc_j * (q - 4).
//   kKq2 (q2_K), 320 bytes: d fp16 [16] | dmin fp16 [16] | scales[16][16]
//         (GGUF's byte j of row r at 64 + 16 j + r: sc_j in the low nibble,
//         m_j in the high one); sub-blocks of 16 k, W = d*sc_j * q - dmin*m_j,
//         its codes in the 2-bit plane.
//   kKiq4 (IQ4_XS), 160 bytes: d fp16 [16] | int8 scales[8][16] (sub-block j of
//         32 k of row r at 32 + 16 j + r: GGUF's 6-bit ls_j - 32, unpacked from
//         scales_h / scales_l when the blocks are repacked); W = d*sc_j * v(q),
//         v the IQ4_NL table (CodeTable::kIq4nl). kKq6's layout with 8 sub-blocks.
// d*sc and dmin*m are exact in fp32 (11-bit by <= 7-bit integers).
constexpr int64_t kKSuperK = 256;
inline bool is_kquant(ScaleType t) {
  return t == ScaleType::kKq45 || t == ScaleType::kKq6 || t == ScaleType::kKq2 ||
         t == ScaleType::kKiq4;
}
inline int64_t kquant_record_bytes(ScaleType t) {
  switch (t) {
    case ScaleType::kKq45:
      return 256;
    case ScaleType::kKq6:
      return 288;
    case ScaleType::kKiq4:
      return 160;
    default:
      return 320;
  }
}
// Sub-blocks (scale groups) per super-block.
inline int64_t kquant_sub_blocks(ScaleType t) {
  return t == ScaleType::kKq45 || t == ScaleType::kKiq4 ? 8 : 16;
}
// Whether the records are d fp16 [16] | int8 sub-scales [j][16] (q6_K, q3_K, IQ4_XS).
inline bool kquant_int8_scales(ScaleType t) {
  return t == ScaleType::kKq6 || t == ScaleType::kKiq4;
}
constexpr int64_t kKquantMaxSubBlocks = 16;
// Whether the records hold mins (W = s * q - z): q4_K, q5_K, q2_K.
inline bool kquant_has_mins(ScaleType t) { return t == ScaleType::kKq45 || t == ScaleType::kKq2; }
constexpr int64_t kKq45MinOffset = 32;    // dmin fp16 [16]
constexpr int64_t kKq45ScaleOffset = 64;  // scales[12][16]
constexpr int64_t kKq6ScaleOffset = 32;   // int8 scales[16][16] (kKiq4: [8][16])
constexpr int64_t kKq2MinOffset = 32;     // dmin fp16 [16]
constexpr int64_t kKq2ScaleOffset = 64;   // scales[16][16]: sc | m << 4

// get_scale_min_k4 for one row: the 6-bit scale (min = false) or min of
// sub-block j from bytes q[i] = GGUF scales[i] of that row (stride 16).
inline int kquant_sub_q45(const uint8_t* q, int j, bool min) {
  const int r = 16;  // byte stride between GGUF scales[i] of one row
  if (j < 4) return min ? (q[(j + 4) * r] & 63) : (q[j * r] & 63);
  return min ? ((q[(j + 4) * r] >> 4) | ((q[j * r] >> 6) << 4))
             : ((q[(j + 4) * r] & 15) | ((q[(j - 4) * r] >> 6) << 4));
}

// Whether a qint projection's weights subtract zeros (W = s * q - z): stored zeros, or
// the q4_K / q5_K / q2_K mins inside the scale records.
inline bool qint_subtracts_zeros(ScaleType scale_type, bool stored_zeros) {
  return stored_zeros || kquant_has_mins(scale_type);
}

// Activations a format multiplies with.
enum class ActType : uint8_t { kF32, kQ8 };

// The table a stored 4-bit code goes through before it is multiplied (the kernel code).
enum class CodeTable : uint8_t {
  kNone,   // the stored code itself
  kE2m1,   // mxfp4, nvfp4: 2 * e2m1(c) + 12, unsigned (zero_offset 12)
  kIq4nl,  // iq4_nl, iq4_xs: kvalues_iq4nl[c] (ggml-quants.c), signed 8-bit
};

struct QintFormat {
  int bits = 4;            // bits per stored code: 2, 3, 4, 5, 6 or 8
  bool is_signed = false;  // the kernel codes are signed bytes: 8-bit codes and the IQ4_NL
                           // table's values; other 4/5/6-bit codes are unsigned
  CodeTable table = CodeTable::kNone;
  ScaleType scale_type = ScaleType::kF32;
  ScaleType zero_type = ScaleType::kNone;  // kNone: implicit zero = scale * zero_offset
  float zero_offset = 0.f;                 // 2^(bits-1), 12 for mxfp4, 0 for signed codes
  int64_t group_size = 0;                  // k per group; 0 = one group over all of Kp
};

inline int64_t qint_k_padded(int64_t k) {
  return (k + kQintKAlign - 1) / kQintKAlign * kQintKAlign;
}
inline int64_t qint_row_blocks(int64_t n) { return (n + kQintBlockRows - 1) / kQintBlockRows; }
// Bits per code in the low plane: 8-bit codes whole, 4/5/6-bit codes' low nibbles,
// 2/3-bit codes' low bit pairs. The rest (5, 6, 3 bits) are in the high plane after it.
constexpr int qint_low_plane_bits(int bits) { return bits == 8 ? 8 : bits >= 4 ? 4 : 2; }
// Bytes of one 16-row block: low plane plus the high plane.
inline int64_t qint_block_bytes(int bits, int64_t kp) { return kQintBlockRows * kp * bits / 8; }
inline int64_t qint_low_plane_bytes(int bits, int64_t kp) {
  return kQintBlockRows * kp * qint_low_plane_bits(bits) / 8;
}
// Groups along K (G): Kp / group_size, or 1 for a per-channel format.
inline int64_t qint_groups(int64_t group_size, int64_t kp) {
  return group_size == 0 ? 1 : kp / group_size;
}
// Bytes of the scales of one 16-row block (`scale_bytes` per stored value;
// k-quants: their records).
inline int64_t qint_block_param_bytes(ScaleType t, int64_t groups, int64_t kp,
                                      int64_t scale_bytes) {
  if (is_kquant(t)) return kp / kKSuperK * kquant_record_bytes(t);
  return groups * kQintBlockRows * scale_bytes;
}
// The k-granularity at which the kernels fold int32 sums into fp32: a
// group boundary or an activation block (32), whichever is finer.
inline int64_t qint_fold_unit(int64_t group_size) { return group_size == 16 ? 16 : 32; }

// The value of one E2M1 code (OCP Microscaling Formats v1.0, section 5.3.3).
inline float e2m1_value(int code) {
  static const float kTable[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float v = kTable[code & 7];
  return (code & 8) ? -v : v;
}
// The unsigned code the kernels multiply for an E2M1 code: 2*value + 12. The
// vector tiers load their byte-shuffle tables from these arrays.
alignas(16) inline constexpr uint8_t kE2m1KernelCodes[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                             12, 11, 10, 9,  8,  6,  4,  0};
inline uint8_t e2m1_kernel_code(int code) { return kE2m1KernelCodes[code & 15]; }

// IQ4_NL's non-linear 4-bit grid (llama.cpp ggml-quants.c, kvalues_iq4nl; the
// gguf package's IQ4_NL.kvalues): the signed value of code c, W = d * value.
alignas(16) inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                        1,    13,   25,  38,  53,  69,  89,  113};
inline int iq4nl_value(int code) { return kIq4nlValues[code & 15]; }
// The kernel code of a stored 4-bit code c of a format with a table.
inline int table_code(CodeTable t, int code) {
  if (t == CodeTable::kE2m1) return e2m1_kernel_code(code);
  if (t == CodeTable::kIq4nl) return iq4nl_value(code);
  return code;
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One stored scale / zero as fp32. For kE8M0 the stored byte E is the MX
// shared exponent and the value returned is the kernel scale 2^(E-128)
// (the E2M1 codes are doubled, see e2m1_kernel_code).
inline float scale_value(const void* base, ScaleType t, int64_t index) {
  switch (t) {
    case ScaleType::kF32:
      return static_cast<const float*>(base)[index];
    case ScaleType::kF16:
      return half_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case ScaleType::kBF16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[index]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case ScaleType::kE8M0: {
      const int e = static_cast<const uint8_t*>(base)[index];
      // 2^(e-128), flushed to zero below the fp32 normal range (E < 2).
      if (e < 2) return 0.f;
      const uint32_t bits = static_cast<uint32_t>(e - 1) << 23;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case ScaleType::kNone:
    case ScaleType::kKq45:
    case ScaleType::kKq6:
    case ScaleType::kKq2:
    case ScaleType::kKiq4:
      break;
  }
  return 0.f;
}

// Scale (min = false) or zero (min = true: dmin*m; 0 for q6_K / q3_K / IQ4_XS) of row r
// and group g of one block's k-quant records `recs` ([Kp/256][record]).
inline float kquant_param(const void* recs, ScaleType t, int64_t g, int r, bool min) {
  const int64_t subs = kquant_sub_blocks(t);
  const uint8_t* rec = static_cast<const uint8_t*>(recs) + (g / subs) * kquant_record_bytes(t);
  const int j = static_cast<int>(g % subs);
  if (kquant_int8_scales(t)) {
    if (min) return 0.f;
    return scale_value(rec, ScaleType::kF16, r) *
           static_cast<float>(static_cast<int8_t>(rec[kKq6ScaleOffset + 16 * j + r]));
  }
  if (t == ScaleType::kKq2) {
    const float d = scale_value(rec + (min ? kKq2MinOffset : 0), ScaleType::kF16, r);
    const int b = rec[kKq2ScaleOffset + 16 * j + r];
    return d * static_cast<float>(min ? b >> 4 : b & 15);
  }
  const float d = scale_value(rec + (min ? kKq45MinOffset : 0), ScaleType::kF16, r);
  return d * static_cast<float>(kquant_sub_q45(rec + kKq45ScaleOffset + r, j, min));
}

// Scalar reference decode of the code q[r][k] (r < 16, k < Kp) of one block,
// as the kernel multiplies it (table codes already mapped: E2M1 to 2*v + 12, IQ4_NL
// to its values).
inline int qint_code(const uint8_t* block, const QintFormat& f, int64_t kp, int r, int64_t k) {
  if (f.bits == 8) {
    const uint8_t b = block[(k / 4) * 64 + r * 4 + (k % 4)];
    return static_cast<int8_t>(b);
  }
  const int64_t half = k / 4;  // half-set index h (4 k each)
  const int j = static_cast<int>(k % 4);
  const uint8_t* high = block + qint_low_plane_bytes(f.bits, kp);
  if (f.bits <= 3) {  // 2-bit low plane: quad h in bits 2 (h % 4), one line per 16 k
    int q = (block[(half / 4) * 64 + r * 4 + j] >> (2 * (half % 4))) & 3;
    if (f.bits == 3) q |= ((high[(half / 8) * 64 + r * 4 + j] >> (half % 8)) & 1) << 2;
    return q;
  }
  const uint8_t lo = block[(half / 2) * 64 + r * 4 + j];
  int q = (half % 2) ? (lo >> 4) : (lo & 15);
  if (f.table != CodeTable::kNone) return table_code(f.table, q);
  if (f.bits == 5) {
    const uint8_t hb = high[(half / 8) * 64 + r * 4 + j];
    q |= ((hb >> (half % 8)) & 1) << 4;
  } else if (f.bits == 6) {
    const uint8_t hb = high[(half / 4) * 64 + r * 4 + j];
    q |= ((hb >> (2 * (half % 4))) & 3) << 4;
  }
  return q;
}

}  // namespace kt::formats
