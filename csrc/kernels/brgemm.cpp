#include "kernels/brgemm.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "formats/bf16.h"
#include "formats/q8_activations.h"
#include "kernels/block_args.h"
#include "kernels/tiers.h"
#include "runtime/cpu_features.h"

#ifdef KT_HAVE_CPUBLAS_BRGEMM
#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#endif

namespace kt::kernels::brgemm {

namespace {

// u8s8: K chunks per epilogue pass (their int32 sums stay in L1 in between).
constexpr int kFoldChunks = 4;

// The token tiles of the u8s8 and w8a8 A operands: at most kMaxTileRows rows each (the
// last one shorter), each followed by its row of 128s (the compensation). f(i, rows,
// row0) for the tile of token rows [i, i + rows), which starts at row row0 of the
// operand (each earlier tile carries one extra row).
template <class F>
void for_each_token_tile(int m, const F& f) {
  for (int i = 0, tile = 0; i < m; i += kMaxTileRows, ++tile)
    f(i, std::min(kMaxTileRows, m - i), i + tile);
}

// Band scales of ones for avx512::scale_rows_to_bf16: the activations rounded to bf16 as
// they are (fp8_channel, mxfp8, fp8's exact tiles and the exact qint tiles).
const float* unit_band_scales(const DotArgs& a) {
  static const std::vector<float> ones(1 << 16, 1.0f);  // ceil(k/128) <= 65536: k < 8M
  TORCH_CHECK(
      formats::ceil_div(a.proj->k, formats::kFp8ScaleBlock) <= static_cast<int64_t>(ones.size()),
      "kt_ops: K too large for the tile kernels' bf16 rows");
  return ones.data();
}

// The slot of op.scratch holding a's rows times a band's scales, rounded to bf16 (one
// projection's band on this pool thread: made on a miss, in the least recently used
// slot, whose group results and group sums are then dropped): rows tile_rows_ld(kp)
// apart for oneDNN's brgemm, or packed as kt_ops' tiles read them (the fused fp8 and
// the exact qint tiles; avx512::scale_rows_to_bf16_packed). The slots are emptied when
// an op call starts (TileScratch::reset), so (x, m, scales, packed) names rows of this
// call; rows with unit scales serve fp8's exact tiles and the qint tiles alike.
TileScratch::Slot& scaled_rows(const DotArgs& a, TileScratch& ts, const float* scales,
                               bool packed) {
  bool hit = false;
  TileScratch::Slot& s = ts.find(
      [&](const TileScratch::Slot& c) {
        return c.x != nullptr && c.x == a.x && c.m == a.m && c.scales == scales &&
               c.packed == packed;
      },
      &hit);
  if (!hit) {
    const int64_t kp = a.proj->kp;
    if (packed)
      avx512::scale_rows_to_bf16_packed(a.x, a.m, kp, scales,
                                        reinterpret_cast<uint32_t*>(s.rows.data()));
    else
      avx512::scale_rows_to_bf16(a.x, a.m, kp, scales, s.rows.data(), tile_rows_ld(kp));
    s.x = a.x;
    s.m = a.m;
    s.scales = scales;
    s.packed = packed;
    s.sums_k = 0;
  }
  return s;
}

#ifdef KT_HAVE_CPUBLAS_BRGEMM
// One bf16 brgemm call on the calling thread: a 1 x 16 x 2 product with known
// bits. oneDNN throws (c10::Error or dnnl::error) where it does not run the
// type, e.g. "could not generate a kernel" on AVX-512 without BF16, or where
// torch.backends.mkldnn is off.
bool probe_bf16() {
  try {
    alignas(64) c10::BFloat16 a[2] = {c10::BFloat16(1.0f), c10::BFloat16(2.0f)};
    alignas(64) c10::BFloat16 b[32];
    for (int r = 0; r < 16; ++r) {
      b[2 * r] = c10::BFloat16(static_cast<float>(r));
      b[2 * r + 1] = c10::BFloat16(0.5f);
    }
    alignas(64) float c[16] = {};
    at::native::cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
    for (int r = 0; r < 16; ++r)
      if (c[r] != static_cast<float>(r) + 1.0f) return false;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// One u8s8 brgemm call: a 1 x 16 x 4 product with known int32 results, B in
// the VNNI layout [K/4][16][4] with negative codes.
bool probe_u8s8() {
  try {
    alignas(64) unsigned char a[4] = {1, 2, 3, 255};
    alignas(64) signed char b[64];
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 4; ++j) b[4 * r + j] = static_cast<signed char>(r - 8 * j);
    alignas(64) int32_t c[16] = {};
    at::native::cpublas::brgemm(1, 16, 4, 4, 16, 16, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
    for (int r = 0; r < 16; ++r) {
      int32_t want = 0;
      for (int j = 0; j < 4; ++j) want += static_cast<int32_t>(a[j]) * (r - 8 * j);
      if (c[r] != want) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}
#endif

bool u8s8_probed_ok() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  static const bool ok = probe_u8s8();
  return ok;
#else
  return false;
#endif
}

bool bf16_probed_ok() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  static const bool ok = probe_bf16();
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool built() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  return true;
#else
  return false;
#endif
}

namespace {
// Built, and oneDNN enabled (torch.backends.mkldnn), checked before any probe.
bool onednn_enabled() {
  if (!built()) return false;
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  if (!at::globalContext().userEnabledMkldnn()) return false;
#endif
  return true;
}
}  // namespace

bool bf16_runs() {
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (!f.avx512_bf16 && !f.amx) return false;  // emulated or refused
  return onednn_enabled() && bf16_probed_ok();
}

bool u8s8_runs() {
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (!f.avx512_vnni && !f.amx) return false;
  if (avx512::brgemm_q8_fold == nullptr) return false;
  return onednn_enabled() && u8s8_probed_ok();
}

bool fp8_runs() {
  // The decode rounds with vcvtne2ps2bf16 (AVX512_BF16), also on AMX CPUs.
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (!f.avx512_bf16 || avx512::fp8_to_bf16_vnni == nullptr ||
      avx512::scale_rows_to_bf16 == nullptr || avx512::scale_columns16 == nullptr ||
      avx512::fp8_e8m0_fits_bf16 == nullptr || avx512::fp8_kernels == nullptr)
    return false;
  return onednn_enabled() && bf16_probed_ok();
}

bool kt_bf16_runs() { return bf16_runs() && bf16_uses_kt_kernel(); }

bool kt_fp8_runs() { return fp8_runs() && fp8_uses_kt_kernel(); }

bool fp8_tiles_exact(const formats::FormatRow& format) {
  if (format.layout != formats::Layout::kFp8 || !fp8_applies(format) || !fp8_runs()) return false;
  return format.fp8_row_scales || fp8_uses_kt_kernel();
}

bool kt_w4a8_runs() {
  return avx512::w4a8_dp_dot != nullptr && avx512::pack_w4a8_dp_rows != nullptr && kt_w8a8_runs();
}

bool w4a8_applies(const formats::FormatRow& format) {
  // Unsigned 4-bit integer codes with a per-channel variant (int4): not mxfp4 / nvfp4
  // (E2M1 tables), iq4 (IQ4_NL tables), the k-quants (their records) or q4_0 (groups of
  // 32 only).
  const formats::QintFormat& q = format.qint;
  const bool per_channel = std::find(format.group_sizes.begin(), format.group_sizes.end(),
                                     int64_t{0}) != format.group_sizes.end();
  return format.layout == formats::Layout::kQint && q.bits == 4 && !q.is_signed &&
         q.table == formats::CodeTable::kNone && !formats::is_kquant(q.scale_type) &&
         format.activation == formats::ActType::kQ8 && per_channel;
}

bool w4a8_applies_to(const ProjectionView& view) { return view.qint.group_size == 0; }

bool w4a8_onednn_applies_to(const ProjectionView& view) {
  const int64_t g = view.qint.group_size;
  return view.kp <= kW8A8MaxK &&
         (g == 0 || (g >= kW4A8MinGroup && g % kU8S8Chunk == 0 && view.kp % g == 0));
}

bool w4a8_runs() {
  return avx512::int4_to_s8_vnni != nullptr && avx512::w4a8_epilogue != nullptr && w8a8_runs();
}

bool kt_w8a8_runs() {
  if (avx512::w8a8_dp_dot == nullptr || avx512::pack_w8a8_dp_rows == nullptr ||
      avx512::quantize_rows_i8_token == nullptr)
    return false;
  const Bf16Kernel k = bf16_kernel_setting();
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (k == Bf16Kernel::kOneDnn || !f.avx512_vnni) return false;
  return k == Bf16Kernel::kKt || !f.amx;  // AMX: oneDNN's tiles, unless forced
}

bool fp8_applies(const formats::FormatRow& format) {
  // fp8_channel: unit band scales, its row scales applied to the outputs (below);
  // mxfp8: unit band scales, its exponents per row and 32 k moved into the decoded
  // bf16 values (exact: powers of two), where they fit (fp8_e8m0_fits_bf16).
  return !format.fp8_row_scales || format.default_group_size == 0 ||
         (format.packed_scale_type == formats::ScaleType::kE8M0 &&
          format.default_group_size == formats::kMxfp8GroupK);
}

bool u8s8_applies(const formats::FormatRow& format) {
  const formats::QintFormat& q = format.qint;
  return format.layout == formats::Layout::kQint && q.bits == 8 && q.is_signed &&
         q.table == formats::CodeTable::kNone && format.zeros == formats::ZeroPolicy::kNever &&
         format.activation == formats::ActType::kQ8;
}

namespace {
std::atomic<Bf16Kernel> g_bf16_kernel{Bf16Kernel::kAuto};
}  // namespace

void set_bf16_kernel(Bf16Kernel k) { g_bf16_kernel.store(k, std::memory_order_relaxed); }

Bf16Kernel bf16_kernel_setting() { return g_bf16_kernel.load(std::memory_order_relaxed); }

bool bf16_uses_kt_kernel() {
  const Bf16Kernel k = bf16_kernel_setting();
  if (k == Bf16Kernel::kOneDnn || avx512::bf16_dp_dot == nullptr) return false;
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (!f.avx512_bf16) return false;
  return k == Bf16Kernel::kKt || !f.amx;  // AMX: oneDNN's tiles, unless forced
}

namespace {
// Whether oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA), read
// once, leaves AMX on: unset, ALL or an AMX class. The cap turns kt_ops' AMX tiles off
// with oneDNN's, so that one variable makes an AMX host compute as a lower class
// (scripts/test.sh reruns the brgemm tests that way).
bool onednn_cap_allows_amx() {
  static const bool allows = [] {
    const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
    if (cap == nullptr || cap[0] == '\0') cap = std::getenv("DNNL_MAX_CPU_ISA");
    if (cap == nullptr || cap[0] == '\0') return true;
    std::string c(cap);
    for (char& ch : c) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    return c == "ALL" || c.find("AMX") != std::string::npos;
  }();
  return allows;
}

// What every kt_ops AMX kernel needs: the setting 'auto', an AMX CPU, oneDNN's cap leaving
// AMX on, and Linux's grant of the tile data (asked last: a system call, once).
bool amx_tiles_run() {
  if (avx512::amx_tiles_permitted == nullptr) return false;
  if (bf16_kernel_setting() != Bf16Kernel::kAuto || !runtime::cpu_features().amx) return false;
  return onednn_cap_allows_amx() && avx512::amx_tiles_permitted();
}
}  // namespace

bool amx_bf16_runs() {
  return avx512::amx_bf16_dot != nullptr && avx512::amx_bf16_dot_pair != nullptr && bf16_runs() &&
         amx_tiles_run();
}

bool amx_w8a8_runs() {
  return avx512::amx_w8a8_dot != nullptr && avx512::amx_w8a8_dot_pair != nullptr &&
         avx512::pack_amx_w8a8_rows != nullptr && w8a8_runs() && amx_tiles_run();
}

bool amx_w8a8_applies_to(const ProjectionView& view) { return view.kp <= kW8A8MaxK; }

void amx_w8a8_dot(const DotArgs& a, const TileOperand& op) {
  avx512::amx_w8a8_dot(a, op);
  release();
}

void amx_w8a8_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op) {
  avx512::amx_w8a8_dot_pair(a0, a1, op);
  release();
}

int64_t amx_w8a8_bytes(int m, int64_t kp) { return avx512::amx_w8a8_bytes(m, kp); }

bool amx_int8_bf16_runs() {
  return avx512::amx_int8_bf16_dot != nullptr && avx512::amx_int8_bf16_dot_pair != nullptr &&
         amx_bf16_runs() && int8_bf16_runs();
}

void amx_int8_bf16_dot(const DotArgs& a, const TileOperand& op) {
  avx512::amx_int8_bf16_dot(a, op);
  release();
}

void amx_int8_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op) {
  avx512::amx_int8_bf16_dot_pair(a0, a1, op);
  release();
}

bool amx_w4a8_runs() {
  if (avx512::amx_w4a8_dot == nullptr || avx512::amx_w4a8_dot_pair == nullptr ||
      avx512::pack_amx_w4a8_rows == nullptr)
    return false;
  return amx_w8a8_runs() && w4a8_runs();
}

void amx_w4a8_dot(const DotArgs& a, const TileOperand& op) {
  avx512::amx_w4a8_dot(a, op);
  release();
}

void amx_w4a8_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op) {
  avx512::amx_w4a8_dot_pair(a0, a1, op);
  release();
}

int64_t amx_w4a8_bytes(int m, int64_t kp) { return avx512::amx_w4a8_bytes(m, kp); }

void amx_bf16_dot(const DotArgs& a, const TileOperand& op) {
  avx512::amx_bf16_dot(a, op);
  release();
}

void amx_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op) {
  avx512::amx_bf16_dot_pair(a0, a1, op);
  release();
}

bool fp8_uses_kt_kernel() {
  return bf16_uses_kt_kernel() && avx512::fp8_dp_block != nullptr &&
         runtime::cpu_features().avx512_vbmi;
}

namespace {
std::atomic<bool>& bf16_pairs_flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("KT_OPS_BRGEMM_BF16_PAIRS");
    return v != nullptr && v[0] == '1';
  }()};
  return on;
}
}  // namespace

bool bf16_pairs() { return bf16_pairs_flag().load(std::memory_order_relaxed); }
void set_bf16_pairs(bool on) { bf16_pairs_flag().store(on, std::memory_order_relaxed); }

#ifdef KT_HAVE_CPUBLAS_BRGEMM
namespace {

// Block nb's 16 columns of its group's products (the kTileGroupBlocks blocks from g0, ncol
// columns side by side): kept from an earlier block of the group on this thread
// (TileScratch::find_results), else computed by fill(out [m][ncol]). fill returns false
// where it computes nothing; so does this, and the caller computes block nb otherwise.
template <class Fill>
bool group_block(const DotArgs& a, TileScratch& ts, int64_t nb, int64_t g0, int ncol,
                 const Fill& fill) {
  const uint8_t* group = a.proj->block(a.expert, g0);
  bool hit = false;
  TileScratch::Results& r = ts.find_results(a.x, a.m, group, &hit);
  if (!hit) {
    if (!fill(r.out.data())) return false;
    r.group = group;
  }
  float* out = a.out + 16 * (nb - a.nb_begin);
  const float* c = r.out.data() + 16 * (nb - g0);
  for (int i = 0; i < a.m; ++i) std::memcpy(out + i * a.ldo, c + i * ncol, 16 * sizeof(float));
  return true;
}

// Block nb's products from its pair's: blocks g0, g0 + 1 interleaved into one VNNI tile
// [k/2][32][2] (64 bytes of each per k pair; the next pair's lines prefetched to L2
// meanwhile) and one N = 32 call per token tile, on a miss.
void bf16_pair_block(const DotArgs& a, const TileOperand& op, int64_t nb) {
  const ProjectionView& p = *a.proj;
  const int64_t kp2 = formats::bf16_k_pairs(p.k);
  const auto* x = static_cast<const uint16_t*>(op.rows);
  const int64_t g0 = nb - nb % kTileGroupBlocks;
  TileScratch& ts = *op.scratch;
  const uint8_t* group = p.block(a.expert, g0);
  constexpr int kCols = 16 * kTileGroupBlocks;
  group_block(a, ts, nb, g0, kCols, [&](float* c) {
    uint16_t* tile = ts.tile.data();
    const uint8_t* next = p.block(a.expert, std::min(g0 + 2 * kTileGroupBlocks, p.row_blocks)) -
                          kTileGroupBlocks * p.block_bytes;  // the next pair, clamped
    for (int64_t q = 0; q < kp2; ++q) {
      for (int b = 0; b < kTileGroupBlocks; ++b) {
        const int64_t off = b * p.block_bytes + q * 64;
        std::memcpy(tile + (q * kCols + 16 * b) * 2, group + off, 64);
        __builtin_prefetch(next + off, 0, 2);
      }
    }
    bf16_gemm(a.m, kCols, 2 * kp2, x, op.ld, tile, c, kCols, false);
    return true;
  });
}

}  // namespace
#endif

void bf16_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const int64_t kp2 = formats::bf16_k_pairs(a.proj->k);
  const int64_t k = 2 * kp2;  // even: the VNNI pairs
  const auto* x = static_cast<const uint16_t*>(op.rows);
  // Pairs where the plan sized op.scratch for them (it asked bf16_pairs() first).
  const bool pairs =
      bf16_pairs() && a.x != nullptr && op.scratch != nullptr &&
      op.scratch->tile.size() >= static_cast<size_t>(kp2 * 32 * kTileGroupBlocks) &&
      op.scratch->results[0].out.size() >= static_cast<size_t>(a.m) * 16 * kTileGroupBlocks;
  const int64_t paired_end = a.proj->row_blocks / kTileGroupBlocks * kTileGroupBlocks;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    if (pairs && nb < paired_end) {
      bf16_pair_block(a, op, nb);
      continue;
    }
    bf16_gemm(a.m, 16, k, x, op.ld, reinterpret_cast<const uint16_t*>(a.proj->block(a.expert, nb)),
              a.out + 16 * (nb - a.nb_begin), a.ldo, false);
  }
#else
  (void)a;
  (void)op;
#endif
}

void gather_u8s8_rows(const uint8_t* const* records, int m, int64_t kp, uint8_t* dst) {
  constexpr int kC = kU8S8Chunk;
  for (int i = 0; i < m; i += kMaxTileRows) {
    const int rows = std::min(kMaxTileRows, m - i);
    // Chunk-major within the tile: chunk c is [rows + 1][32] at dst + c * (rows + 1) * 32.
    const int64_t chunk_bytes = static_cast<int64_t>(rows + 1) * kC;
    for (int j = 0; j < rows; ++j) {
      const uint8_t* src = records[i + j];  // the record's int8 codes come first
      uint8_t* d = dst + j * kC;
      for (int64_t c = 0; c < kp / kC; ++c, src += kC, d += chunk_bytes)
        for (int k = 0; k < kC; ++k) d[k] = static_cast<uint8_t>(src[k] ^ 0x80u);  // + 128
    }
    for (int64_t c = 0; c < kp / kC; ++c)  // the tile's compensation row
      std::fill_n(dst + c * chunk_bytes + rows * kC, kC, uint8_t{128});
    dst += (rows + 1) * kp;
  }
}

void u8s8_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const ProjectionView& p = *a.proj;
  const int64_t kp = p.kp;
  const int64_t chunks = kp / kU8S8Chunk;
  constexpr int64_t kChunkBytes = int64_t{kU8S8Chunk} * 16;  // one chunk of a 16-row block
  // kFoldChunks chunks of [tile rows + 1][16] int32 sums (16.6 KB: the stack,
  // no per-thread buffer to own).
  alignas(64) int32_t c[kFoldChunks * (kMaxTileRows + 1) * 16];
  const auto* xu8 = static_cast<const uint8_t*>(op.rows);
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const QintBlock blk = qint_block(a, nb);
    const auto* w = reinterpret_cast<const signed char*>(blk.block);
    for_each_token_tile(a.m, [&](int i, int rows, int row0) {
      const uint8_t* xa = xu8 + row0 * kp;
      const int64_t a_chunk = static_cast<int64_t>(rows + 1) * kU8S8Chunk;  // chunk-major A
      float* out = blk.out + i * blk.ldo;
      for (int r = 0; r < rows; ++r) std::fill(out + r * blk.ldo, out + r * blk.ldo + 16, 0.0f);
      const int64_t cstride = static_cast<int64_t>(rows + 1) * 16;
      for (int64_t c0 = 0; c0 < chunks; c0 += kFoldChunks) {
        const int nc = static_cast<int>(std::min<int64_t>(kFoldChunks, chunks - c0));
        for (int j = 0; j < nc; ++j)
          at::native::cpublas::brgemm(rows + 1, 16, kU8S8Chunk, kU8S8Chunk, 16, 16, false,
                                      xa + (c0 + j) * a_chunk, w + (c0 + j) * kChunkBytes,
                                      c + j * cstride, true);
        avx512::brgemm_q8_fold(c, nc, rows, a.xq + i, kp, c0, blk.scales, p.qint.scale_type,
                               p.qint.group_size, out, blk.ldo);
      }
    });
  }
#else
  (void)a;
  (void)op;
#endif
}

bool int8_per_channel_applies(const formats::FormatRow& format) {
  // Per output channel only: one weight scale per row factors out of the full-K sum.
  return u8s8_applies(format) && format.group_sizes.size() == 1 && format.group_sizes[0] == 0;
}

bool w8a8_runs() {
  return avx512::quantize_rows_i8_token != nullptr && avx512::w8a8_epilogue != nullptr &&
         u8s8_runs();
}

void pack_w8a8_rows(const float* const* x, int m, int64_t kp, uint8_t* dst) {
  auto* scales = reinterpret_cast<float*>(dst);
  uint8_t* tiles = dst + w8a8_scale_bytes(m);
  const int64_t ld = w8a8_ld(kp);
  for_each_token_tile(m, [&](int i, int rows, int row0) {
    uint8_t* tile = tiles + row0 * ld;
    avx512::quantize_rows_i8_token(x + i, rows, kp, tile, ld, scales + i);
    std::fill_n(tile + rows * ld, kp, uint8_t{128});  // the compensation row
  });
}

// Where kt_ops' bf16 tiles run (AVX512_BF16 without AMX, or forced by brgemm_bf16_kernel =
// 'kt'), int8 goes on down the chain to the exact qint tiles: the same exact products in
// the same vdpbf16ps chain over k, then the channel scale (bit-identical to oneDNN's
// AVX512_BF16 kernel), with the rows packed per tile: the LoRA forward on an int8 base
// (Qwen3-30B-A3B layer, T = 512, Zen 4, same process, alternating) 155.7 -> 145.4 ms.
bool int8_bf16_runs() {
  return avx512::int8_to_bf16_vnni != nullptr && avx512::scale_columns16 != nullptr &&
         bf16_runs() && !(bf16_uses_kt_kernel() && qint_dp_exact_runs());
}

void int8_bf16_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const ProjectionView& p = *a.proj;
  uint16_t* tile = op.scratch->tile.data();  // >= kp * 16 (TileScratch::reserve)
  const auto* x = static_cast<const uint16_t*>(op.rows);
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const QintBlock blk = qint_block(a, nb);
    avx512::int8_to_bf16_vnni(blk.block, p.kp, tile);
    bf16_gemm(a.m, 16, p.kp, x, op.ld, tile, blk.out, blk.ldo, false);
    avx512::scale_columns16(blk.out, a.m, blk.ldo, blk.scales, p.qint.scale_type);
  }
#else
  (void)a;
  (void)op;
#endif
}

bool mxfp4_applies(const formats::FormatRow& format) {
  const formats::QintFormat& q = format.qint;
  return format.layout == formats::Layout::kQint && q.bits == 4 &&
         q.table == formats::CodeTable::kE2m1 &&
         format.packed_scale_type == formats::ScaleType::kE8M0;
}

bool mxfp4_applies_to(const ProjectionView& view) {
  return view.qint.scale_type == formats::ScaleType::kE8M0 && view.qint.group_size == 32 &&
         view.zeros == nullptr;
}

// Where oneDNN computes bf16 (AMX, or brgemm_bf16_kernel = 'onednn'); kt_ops' exact qint
// tiles compute the blocks whose exponents leave bf16's range, and mxfp4 everywhere else.
bool mxfp4_runs() {
  return avx512::mxfp4_to_bf16_vnni != nullptr && avx512::e8m0_within != nullptr && bf16_runs() &&
         !bf16_uses_kt_kernel() && qint_dp_exact_runs();
}

#ifdef KT_HAVE_CPUBLAS_BRGEMM
namespace {

// Whether block nb's values are bf16 values (its exponents in [2, 252], as in every real
// checkpoint); rows past N (zero codes) are not looked at.
bool mxfp4_block_in_bf16(const DotArgs& a, int64_t nb) {
  const ProjectionView& p = *a.proj;
  const int rows = static_cast<int>(std::min<int64_t>(16, p.n - 16 * nb));
  return avx512::e8m0_within(static_cast<const uint8_t*>(qint_block(a, nb).scales), p.groups, rows,
                             avx512::kMxfp4BfMinE, avx512::kMxfp4BfMaxE);
}

// Block nb on kt_ops' exact qint tiles (each group's fp32 sums times 2^(E-128)): its
// exponents leave bf16's range. The same bf16(x) rows, from a.x.
void mxfp4_exact_block(const DotArgs& a, TileScratch& ts, int64_t nb) {
  const TileScratch::Slot& s = scaled_rows(a, ts, unit_band_scales(a), true);
  QintBlock blk = qint_block(a, nb);
  blk.m = a.m;
  const bool done = avx512::qint_dp_block(blk, reinterpret_cast<const uint32_t*>(s.rows.data()),
                                          nullptr, ts.tile.data(), ts.params.data());
  TORCH_INTERNAL_ASSERT(done, "mxfp4_dot: the exact qint tiles refused a block");
}

// Block nb's products from its group's (kTileGroupBlocks blocks decoded side by side into
// one [kp/2][16 * blocks][2] tile, one call per token tile, the next group's codes
// prefetched meanwhile), on a miss; gate and up keep one group each (find_results).
void mxfp4_block(const DotArgs& a, const TileOperand& op, int64_t nb) {
  const ProjectionView& p = *a.proj;
  TileScratch& ts = *op.scratch;
  const int64_t g0 = nb - nb % kTileGroupBlocks;
  const int64_t g1 = std::min<int64_t>(p.row_blocks, g0 + kTileGroupBlocks);
  const int ncol = static_cast<int>(16 * (g1 - g0));
  const bool done = group_block(a, ts, nb, g0, ncol, [&](float* c) {
    for (int64_t b = g0; b < g1; ++b)
      if (!mxfp4_block_in_bf16(a, b)) return false;
    for (int64_t b = g0; b < g1; ++b) {
      const uint8_t* codes = p.block(a.expert, b);
      avx512::mxfp4_to_bf16_vnni(codes, static_cast<const uint8_t*>(qint_block(a, b).scales), p.kp,
                                 ts.tile.data() + 2 * 16 * (b - g0), ncol,
                                 codes + kTileGroupBlocks * p.block_bytes);
    }
    bf16_gemm(a.m, ncol, p.kp, static_cast<const uint16_t*>(op.rows), op.ld, ts.tile.data(), c,
              ncol, false);
    return true;
  });
  if (!done) mxfp4_exact_block(a, ts, nb);
}

}  // namespace
#endif

void mxfp4_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) mxfp4_block(a, op, nb);
#else
  (void)a;
  (void)op;
#endif
}

void w8a8_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const ProjectionView& p = *a.proj;
  const int64_t kp = p.kp, ld = w8a8_ld(kp);
  const auto* x_scales = static_cast<const float*>(op.rows);
  const uint8_t* tiles = static_cast<const uint8_t*>(op.rows) + w8a8_scale_bytes(a.m);
  alignas(64) int32_t c[(kMaxTileRows + 1) * 16];  // one tile's sums and its compensation
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const QintBlock blk = qint_block(a, nb);
    const auto* w = reinterpret_cast<const signed char*>(blk.block);  // [kp/4][16][4]
    for_each_token_tile(a.m, [&](int i, int rows, int row0) {
      const uint8_t* xa = tiles + row0 * ld;
      for (int64_t k0 = 0; k0 < kp; k0 += kW8A8MaxK) {
        const int64_t kc = std::min(kW8A8MaxK, kp - k0);
        at::native::cpublas::brgemm(rows + 1, 16, kc, ld, 16, 16, false, xa + k0, w + k0 * 16, c,
                                    true);
        avx512::w8a8_epilogue(c, rows, x_scales + i, blk.scales, p.qint.scale_type, k0 > 0,
                              blk.out + i * blk.ldo, blk.ldo);
      }
    });
  }
#else
  (void)a;
  (void)op;
#endif
}

void pack_w4a8_rows(const float* const* x, int m, int64_t kp, uint8_t* dst) {
  pack_w8a8_rows(x, m, kp, dst);
  // Each row's sum of q over all of K, then over each 32 k (the groups' sums): its codes
  // + 128, less 128 per k.
  auto* sums = reinterpret_cast<int32_t*>(dst + w8a8_bytes(m, kp));
  auto* chunk_sums = reinterpret_cast<int32_t*>(dst + w4a8_chunk_sums_offset(m, kp));
  const int64_t chunks = kp / kU8S8Chunk;
  const uint8_t* tiles = dst + w8a8_scale_bytes(m);
  const int64_t ld = w8a8_ld(kp);
  for_each_token_tile(m, [&](int i, int rows, int row0) {
    for (int r = 0; r < rows; ++r) {
      const uint8_t* row = tiles + (row0 + r) * ld;
      int32_t* cs = chunk_sums + (i + r) * chunks;
      int64_t t = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        int32_t u = 0;
        for (int k = 0; k < kU8S8Chunk; ++k) u += row[c * kU8S8Chunk + k];
        cs[c] = u - 128 * kU8S8Chunk;
        t += cs[c];
      }
      sums[i + r] = static_cast<int32_t>(t);
    }
  });
}

void w4a8_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const ProjectionView& p = *a.proj;
  const int64_t kp = p.kp, ld = w8a8_ld(kp);
  const auto* x_scales = static_cast<const float*>(op.rows);
  const auto* base = static_cast<const uint8_t*>(op.rows);
  const uint8_t* tiles = base + w8a8_scale_bytes(a.m);
  const auto* q_sums = reinterpret_cast<const int32_t*>(base + w8a8_bytes(a.m, kp));
  const auto* chunk_sums = reinterpret_cast<const int32_t*>(base + w4a8_chunk_sums_offset(a.m, kp));
  // Per channel one full-K call per token tile; with groups one call per group (K = the
  // group size), each group's int32 sums folded with its scales (and zeros) in k order.
  const int64_t gk = p.qint.group_size == 0 ? kp : p.qint.group_size;
  const int64_t chunks = kp / kU8S8Chunk, group_chunks = gk / kU8S8Chunk;
  auto* w = reinterpret_cast<int8_t*>(op.scratch->tile.data());  // >= kp * 16 bytes (reserve)
  alignas(64) int32_t c[(kMaxTileRows + 1) * 16];  // one tile's sums and its compensation
  int32_t group_q[kMaxTileRows];                   // the tile's rows' sums of q over a group
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const QintBlock blk = qint_block(a, nb);
    avx512::int4_to_s8_vnni(blk.block, kp, w);  // once per block, for all its token tiles
    for_each_token_tile(a.m, [&](int i, int rows, int row0) {
      for (int64_t g = 0; g * gk < kp; ++g) {
        at::native::cpublas::brgemm(rows + 1, 16, gk, ld, 16, 16, false, tiles + row0 * ld + g * gk,
                                    w + g * gk * 16, c, true);
        const int32_t* qs = q_sums + i;
        if (gk != kp) {
          for (int r = 0; r < rows; ++r) {
            const int32_t* cs = chunk_sums + (i + r) * chunks + g * group_chunks;
            int32_t t = 0;
            for (int64_t j = 0; j < group_chunks; ++j) t += cs[j];
            group_q[r] = t;
          }
          qs = group_q;
        }
        avx512::w4a8_epilogue(c, rows, x_scales + i, qs, blk.scales, p.qint.scale_type, blk.zeros,
                              p.qint.zero_type, g, g > 0, blk.out + i * blk.ldo, blk.ldo);
      }
    });
  }
#else
  (void)a;
  (void)op;
#endif
}

#ifdef KT_HAVE_CPUBLAS_BRGEMM
namespace {

// The band scales the activations are multiplied by: fp8's 128x128 block scales, or
// ones (unit_band_scales) for fp8_channel (one scale per output row, applied by
// scale_outputs) and mxfp8 (its exponents go into the decoded values).
const float* fp8_tile_scales(const DotArgs& a, int64_t nb) {
  return a.proj->fp8_row_scales ? unit_band_scales(a) : fp8_band_scales(a, nb);
}

// mxfp8: block nb's exponents [groups][16] (UE8M0 bytes), else nullptr.
const uint8_t* e8m0_of(const DotArgs& a, int64_t nb) {
  const ProjectionView& p = *a.proj;
  if (!p.fp8_row_scales || p.qint.scale_type != formats::ScaleType::kE8M0) return nullptr;
  return static_cast<const uint8_t*>(p.scales) + (a.expert * p.row_blocks + nb) * p.groups * 16;
}

// Whether block nb's values are exact bf16 values once decoded (always but for
// mxfp8 exponents outside [10, 246], which no real checkpoint holds).
bool decodes_to_bf16(const DotArgs& a, int64_t nb) {
  const uint8_t* e = e8m0_of(a, nb);
  const int rows = static_cast<int>(std::min<int64_t>(16, a.proj->n - 16 * nb));
  return e == nullptr || avx512::fp8_e8m0_fits_bf16(e, a.proj->groups, rows);
}

// Block nb on the streaming kernel (fp32 activations times the exact values):
// mxfp8 blocks whose exponents do not fit bf16's range.
void streaming_block(const DotArgs& a, int64_t nb) {
  DotArgs one = a;
  one.nb_begin = nb;
  one.nb_end = nb + 1;
  one.out = a.out + 16 * (nb - a.nb_begin);
  avx512::fp8_kernels().dot(one);
}

// fp8_channel: block nb's m output rows of 16 times their rows' scales.
void scale_outputs(const DotArgs& a, int64_t nb, float* out) {
  const ProjectionView& p = *a.proj;
  if (!p.fp8_row_scales || p.qint.group_size != 0) return;
  const float* s = static_cast<const float*>(p.scales) + (a.expert * p.row_blocks + nb) * 16;
  avx512::scale_columns16(out, a.m, a.ldo, s, formats::ScaleType::kF32);
}

// oneDNN: block nb's dot products from its group's (computed on a miss).
void fp8_onednn_block(const DotArgs& a, TileScratch& ts, int64_t nb) {
  const ProjectionView& p = *a.proj;
  const int64_t kp = p.kp, ld = tile_rows_ld(kp);
  const int64_t g0 = nb - nb % kTileGroupBlocks;  // the group's blocks [g0, g1), one band
  const int64_t g1 = std::min<int64_t>(p.row_blocks, g0 + kTileGroupBlocks);
  const int ncol = static_cast<int>(16 * (g1 - g0));
  for (int64_t b = g0; b < g1; ++b)
    if (!decodes_to_bf16(a, b)) return streaming_block(a, nb);
  group_block(a, ts, nb, g0, ncol, [&](float* c) {
    const TileScratch::Slot& s = scaled_rows(a, ts, fp8_tile_scales(a, g0), false);
    for (int64_t b = g0; b < g1; ++b) {
      const uint8_t* codes = p.block(a.expert, b);
      // Prefetch the same block of the next group (prefetches never fault).
      avx512::fp8_to_bf16_vnni(codes, kp, ts.tile.data() + 2 * 16 * (b - g0), ncol,
                               codes + kTileGroupBlocks * p.block_bytes, true, e8m0_of(a, b));
    }
    bf16_gemm(a.m, ncol, kp, s.rows.data(), ld, ts.tile.data(), c, ncol, false);
    return true;
  });
  float* out = a.out + 16 * (nb - a.nb_begin);
  scale_outputs(a, nb, out);
}

}  // namespace
#endif

void fp8_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) fp8_onednn_block(a, *op.scratch, nb);
#else
  (void)a;
  (void)op;
#endif
}

#ifdef KT_HAVE_CPUBLAS_BRGEMM
namespace {

// kt_ops' fused tiles. exact: fp8's block scales on each 128-k chunk's fp32 sums of
// bf16(x) times the E4M3 values, not on the activations (fp8_channel and mxfp8 put no
// scale on the activations either way).
void fp8_dp_blocks(const DotArgs& a, const TileOperand& op, bool exact) {
  const int64_t kp = a.proj->kp;  // multiple of 32, zero codes and zero activations past k
  TileScratch& ts = *op.scratch;  // ts.tile: one decoded block for its later token tiles
  const bool chunked = exact && !a.proj->fp8_row_scales;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    if (!decodes_to_bf16(a, nb)) {
      streaming_block(a, nb);
      continue;
    }
    const TileScratch::Slot& s =
        scaled_rows(a, ts, chunked ? unit_band_scales(a) : fp8_tile_scales(a, nb), true);
    float* out = a.out + 16 * (nb - a.nb_begin);
    avx512::fp8_dp_block(reinterpret_cast<const uint32_t*>(s.rows.data()), a.m,
                         a.proj->block(a.expert, nb), kp, ts.tile.data(), out, a.ldo,
                         e8m0_of(a, nb), chunked ? fp8_band_scales(a, nb) : nullptr);
    scale_outputs(a, nb, out);
  }
}

}  // namespace
#endif

void fp8_dp_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  fp8_dp_blocks(a, op, false);
#else
  (void)a;
  (void)op;
#endif
}

void fp8_dp_exact_dot(const DotArgs& a, const TileOperand& op) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  fp8_dp_blocks(a, op, true);
#else
  (void)a;
  (void)op;
#endif
}

bool qint_dp_exact_runs() {
  return avx512::qint_dp_block != nullptr && avx512::scale_rows_to_bf16_packed != nullptr &&
         avx512::qint_dp_group_sums != nullptr && runtime::cpu_features().avx512 &&
         runtime::cpu_features().avx512_bf16;
}

bool qint_dp_exact_applies(const formats::FormatRow& format) {
  const formats::QintFormat& q = format.qint;
  if (format.layout != formats::Layout::kQint) return false;
  if (q.bits == 8) return q.is_signed && q.table == formats::CodeTable::kNone;
  return q.bits >= 2 && q.bits <= 6;
}

bool qint_dp_exact_applies_to(const ProjectionView& view) {
  // 8-bit codes never carry zeros (the kernel decodes them without a table).
  if (view.qint.bits == 8 && view.zeros != nullptr) return false;
  return view.qint.group_size % 16 == 0;  // 0: per channel
}

bool qint_tiles_exact(const formats::FormatRow& format) {
  return qint_dp_exact_applies(format) && qint_dp_exact_runs();
}

void qint_dp_exact_dot(const DotArgs& a, const TileOperand& op) {
  const ProjectionView& p = *a.proj;
  TileScratch& ts = *op.scratch;
  // The slot of a's rows in bf16, packed, and their group sums.
  TileScratch::Slot& s = scaled_rows(a, ts, unit_band_scales(a), true);
  // The rows' sums per group, where the format subtracts zeros (gate and up share them).
  const bool zeros = formats::qint_subtracts_zeros(p.qint.scale_type, p.zeros != nullptr);
  const int64_t group_k = p.qint.group_size == 0 ? p.kp : p.qint.group_size;
  if (zeros && s.sums_k != group_k) {
    avx512::qint_dp_group_sums(reinterpret_cast<const uint32_t*>(s.rows.data()), a.m, p.kp, group_k,
                               s.sums.data());
    s.sums_k = group_k;
  }
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    QintBlock blk = qint_block(a, nb);
    blk.m = a.m;
    const bool done = avx512::qint_dp_block(blk, reinterpret_cast<const uint32_t*>(s.rows.data()),
                                            s.sums.data(), ts.tile.data(), ts.params.data());
    TORCH_CHECK(done, "qint_dp_exact_dot: a ", p.qint.bits, "-bit projection with groups of ",
                group_k, " k, which the kernel does not take");
  }
}

void release() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  at::native::cpublas::brgemm_release(true);
#endif
}

void bf16_gemm(int m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
               float* c, int64_t ldc, bool add_c) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const auto* ab = reinterpret_cast<const c10::BFloat16*>(a);
  const auto* bb = reinterpret_cast<const c10::BFloat16*>(b);
  for (int i = 0; i < m; i += kMaxTileRows) {
    const int rows = std::min(kMaxTileRows, m - i);
    at::native::cpublas::brgemm(rows, n, k, lda, n, ldc, add_c, ab + i * lda, bb, c + i * ldc,
                                true);
  }
#else
  (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)c, (void)ldc, (void)add_c;
  TORCH_CHECK(false, "kt_ops: built without oneDNN's brgemm (bf16_gemm)");
#endif
}

}  // namespace kt::kernels::brgemm
