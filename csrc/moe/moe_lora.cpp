#include "moe/moe_lora.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/BFloat16.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "formats/bf16.h"
#include "kernels/activations.h"
#include "kernels/brgemm.h"
#include "kernels/dispatch.h"
#include "kernels/isa.h"
#include "kernels/tiers.h"
#include "moe/backward_panels.h"
#include "moe/blas_tasks.h"
#include "moe/lora_products.h"
#include "moe/moe_forward.h"
#include "moe/routing.h"
#include "runtime/aligned_vector.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

namespace {

const at::TensorOptions kF32 = at::TensorOptions().dtype(at::kFloat);

// Non-owning fp32 view of memory this file owns or a validated tensor holds.
// from_blob tensors carry no autograd history, whatever the source tensor had.
at::Tensor view(const float* p, at::IntArrayRef sizes) {
  return at::from_blob(const_cast<float*>(p), sizes, kF32);
}

// Active experts, most rows first: long tasks start early, so the dynamic
// hand-out balances. The order does not change any result.
std::vector<int64_t> experts_by_load(const RoutingPlan& plan) {
  std::vector<int64_t> order = plan.active_experts;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return plan.expert_offsets[a + 1] - plan.expert_offsets[a] >
           plan.expert_offsets[b + 1] - plan.expert_offsets[b];
  });
  return order;
}

// rows i of src ([rows, n], row-major) -> dst[index[i] * n ...]. With non-temporal
// stores where the CPU has them: dst is the per-slot gradient of x ([T*K, H], 32 MB at
// T = 512 on a Qwen3-30B-A3B layer), read next by the combine after every expert, so
// caching its lines (read for ownership first) only costs memory traffic (backward at
// T = 2048: 488 -> 481 ms, two runs of three, alternating in one process, Zen 4).
void scatter_rows(const float* src, int64_t rows, int64_t n, const int64_t* index, float* dst) {
#if defined(__SSE2__)
  for (int64_t i = 0; i < rows; ++i) {
    float* d = dst + index[i] * n;
    const float* s = src + i * n;
    int64_t j = 0;
    for (; j < n && (reinterpret_cast<uintptr_t>(d + j) & 15) != 0; ++j) d[j] = s[j];
    for (; j + 4 <= n; j += 4) _mm_stream_ps(d + j, _mm_loadu_ps(s + j));
    for (; j < n; ++j) d[j] = s[j];
  }
  _mm_sfence();  // the stores visible before the pool's barrier releases the combine
#else
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(dst + index[i] * n, src + i * n, n * sizeof(float));
#endif
}

// sum_j a[j] b[j] in a fixed order: 16 interleaved fp32 partial sums (lane j % 16), then
// those added in a fixed tree. One serial chain of n adds (latency-bound, 4 cycles each)
// took 1.5 ms of the T = 512 backward on a Qwen3-30B-A3B layer; this vectorizes.
float dot_lanes(const float* a, const float* b, int64_t n) {
  float lane[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] += a[j + l] * b[j + l];
  for (int l = 0; j < n; ++j, ++l) lane[l] += a[j] * b[j];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

// dst[j * ld + i] = src[i * r + j] for src [n, r]: B [n, r] as B^T's r rows. In 4 x 4
// blocks where SSE is there and r is a multiple of 4 (scalar, B^T of every expert of
// each projection per call was 1% of a LoRA step on Zen 4).
void transpose_rows(const float* src, int64_t n, int64_t r, float* dst, int64_t ld) {
  int64_t i = 0;
#if defined(__SSE2__)
  if (r % 4 == 0) {
    for (; i + 4 <= n; i += 4) {
      for (int64_t j = 0; j < r; j += 4) {
        __m128 a = _mm_loadu_ps(src + i * r + j), b = _mm_loadu_ps(src + (i + 1) * r + j);
        __m128 c = _mm_loadu_ps(src + (i + 2) * r + j), d = _mm_loadu_ps(src + (i + 3) * r + j);
        _MM_TRANSPOSE4_PS(a, b, c, d);
        _mm_storeu_ps(dst + j * ld + i, a);
        _mm_storeu_ps(dst + (j + 1) * ld + i, b);
        _mm_storeu_ps(dst + (j + 2) * ld + i, c);
        _mm_storeu_ps(dst + (j + 3) * ld + i, d);
      }
    }
  }
#endif
  for (; i < n; ++i)
    for (int64_t j = 0; j < r; ++j) dst[j * ld + i] = src[i * r + j];
}

// dst [cols, rows] = src [rows, cols]^T (small: a LoRA factor or its gradient).
void transpose_into(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
}

// dst row i (rows ldd apart; default n) <- src[index[i] * n ...]: fp32 or bf16 rows.
// The next row's lines are prefetched while a row is copied: the rows lie far apart in
// buffers far larger than the caches (the saved pre-activations, x, the output
// gradient), and each row's start was a DRAM miss the hardware prefetchers only follow.
template <class T>
void gather_rows(const T* src, int64_t rows, int64_t n, const int64_t* index, T* dst,
                 int64_t ldd = -1) {
  if (ldd < 0) ldd = n;
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < rows; ++i) {
    if (i + 1 < rows) {
      const char* next = reinterpret_cast<const char*>(src + index[i + 1] * n);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(next + b, 0, 3);
    }
    std::memcpy(dst + i * ldd, src + index[i] * n, bytes);
  }
}

// Rows of the slot sums computed per pool task.
constexpr int64_t kRowsPerCombineTask = 8;

// out[t] = sum over k (ascending) of slots[t*K + k] for valid slots, in out's dtype.
template <class Dst>
void combine_range(const float* slots, const uint8_t* valid, int64_t K, int64_t H, Dst* out,
                   int64_t begin, int64_t end, std::vector<float>& acc) {
  acc.assign(H, 0.0f);
  for (int64_t t = begin; t < end; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      if (!valid[t * K + k]) continue;
      const float* y = slots + (t * K + k) * H;
      for (int64_t j = 0; j < H; ++j) acc[j] += y[j];
    }
    for (int64_t j = 0; j < H; ++j) out[t * H + j] = static_cast<Dst>(acc[j]);
  }
}

void combine_slots(const float* slots, const RoutingPlan& plan, int64_t H, at::Tensor& out) {
  const int64_t T = plan.num_tokens, K = plan.top_k;
  const uint8_t* valid = plan.slot_valid.data();
  runtime::ThreadPool::global().run(
      formats::ceil_div(T, kRowsPerCombineTask), [&](int64_t task, int) {
        const int64_t b = task * kRowsPerCombineTask;
        const int64_t e = std::min(T, b + kRowsPerCombineTask);
        std::vector<float> acc;
        switch (out.scalar_type()) {
          case at::kFloat:
            combine_range(slots, valid, K, H, out.data_ptr<float>(), b, e, acc);
            break;
          case at::kBFloat16:
            combine_range(slots, valid, K, H, out.data_ptr<c10::BFloat16>(), b, e, acc);
            break;
          default:
            combine_range(slots, valid, K, H, out.data_ptr<c10::Half>(), b, e, acc);
            break;
        }
      });
}

// Bytes of one fp32 panel of a projection's weights: about L2 (1 MiB per core on Zen 4,
// 2 MiB on Sapphire Rapids). 256 KiB gave 32-column panels of the down projection
// (n = 2048), whose sgemms ran ~10% slower (m = 32 rows, 2 threads, Zen 4).
constexpr int64_t kPanelBytes = 1024 * 1024;
// The AVX2 NT tiles' panels: inside Zen 3's 512 KiB L2 (1 MiB gave the same backward
// within the host's noise: 757-828 against 767-860 ms at T = 512, alternating runs).
constexpr int64_t kNtPanelBytes = 256 * 1024;

// out = sum_j d_j @ W_j for the backward's products with the frozen base (grad
// of h: go Wd; grad of x: dg Wg + du Wu), W_j an expert's [n, k] projection
// and every d_j [m, n]: per panel of 32-aligned columns of W, decoded to fp32
// (dense_expert_panel) into `panel` and multiplied at once, so the whole fp32
// matrix is never written to or read back from memory.
// Where the tier has its own fp32 NT tiles (kernels/gemm_nt.h: AVX2) they multiply the
// panel as it lies (rows of W^T, read along the reduction like d's rows); else the BLAS.
void base_products(std::initializer_list<std::pair<const at::Tensor*, const Projection*>> terms,
                   int64_t e, at::Tensor& out, runtime::AlignedVector<float>& panel) {
  const Projection& p0 = *terms.begin()->second;
  const int64_t k = p0.k, ld = dense_panel_ld(p0);
  bool dense_rows = out.stride(1) == 1;
  for (const auto& term : terms) dense_rows = dense_rows && term.first->is_contiguous();
  const kernels::GemmNtF32 nt = dense_rows ? kernels::gemm_nt_f32(kernels::active_isa()) : nullptr;
  const int64_t bytes = nt != nullptr ? kNtPanelBytes : kPanelBytes;
  int64_t kc = std::max<int64_t>(32, bytes / (ld * 4) / 32 * 32);
  // The NT tiles prefetch the next panel's source, whose chunks are a power of two of lines.
  if (nt != nullptr)
    while ((kc & (kc - 1)) != 0) kc &= kc - 1;
  if (panel.size() < static_cast<size_t>(kc * ld)) panel.resize(kc * ld);
  const int64_t m = out.size(0);
  const auto* term_list = terms.begin();
  const int64_t nterms = static_cast<int64_t>(terms.size());
  for (int64_t k0 = 0; k0 < k; k0 += kc) {
    const int64_t k1 = std::min(k, k0 + kc);
    bool first = true;
    for (int64_t ti = 0; ti < nterms; ++ti) {
      const auto& [d, p] = term_list[ti];
      dense_expert_panel(*p, e, k0, k1, panel.data());
      if (nt != nullptr) {
        // The panel after this one: the next term's at k0, else the first term's at k1.
        kernels::PrefetchChunks next;
        if (ti + 1 < nterms) {
          next = vnni_panel_source(*term_list[ti + 1].second, e, k0, kc);
        } else if (k1 < k) {
          next = vnni_panel_source(*term_list[0].second, e, k1, kc);
        }
        nt(m, k1 - k0, p->n, d->data_ptr<float>(), p->n, panel.data(), ld,
           out.data_ptr<float>() + k0, out.stride(0), !first, next);
      } else {
        at::Tensor o = out.narrow(1, k0, k1 - k0);
        const at::Tensor wp = at::from_blob(panel.data(), {p->n, k1 - k0}, {1, ld}, kF32);
        if (first) {
          at::mm_out(o, *d, wp);
        } else {
          o.addmm_(*d, wp);
        }
      }
      first = false;
    }
  }
}

// The big elementwise steps of a call (fp32 copies of the activations, zeroed buffers)
// run on kt_ops' pool, not as ATen ops: ATen's would start torch's OpenMP team, whose
// threads then spin beside the pool's (libgomp took ~10% of a backward on 2 cores).
constexpr int64_t kElementsPerTask = int64_t{1} << 16;

template <class Src>
void to_f32_range(const Src* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An fp32 contiguous copy of a CPU float tensor (the tensor itself when it is one).
at::Tensor f32_on_pool(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
  if (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kHalf)
    return t.to(at::kFloat).contiguous();
  const at::Tensor src = t.contiguous();
  at::Tensor out = at::empty(src.sizes(), kF32);
  const int64_t n = src.numel();
  float* dst = out.data_ptr<float>();
  const bool bf16 = src.scalar_type() == at::kBFloat16;
  runtime::ThreadPool::global().run(formats::ceil_div(n, kElementsPerTask), [&](int64_t task, int) {
    const int64_t b = task * kElementsPerTask, len = std::min(kElementsPerTask, n - b);
    if (bf16) {
      to_f32_range(src.data_ptr<c10::BFloat16>() + b, dst + b, len);
    } else {
      to_f32_range(src.data_ptr<c10::Half>() + b, dst + b, len);
    }
  });
  return out;
}

// A zero fp32 tensor.
at::Tensor zeros_on_pool(at::IntArrayRef sizes) {
  at::Tensor out = at::empty(sizes, kF32);
  const int64_t n = out.numel();
  float* p = out.data_ptr<float>();
  runtime::ThreadPool::global().run(formats::ceil_div(n, kElementsPerTask), [&](int64_t task, int) {
    const int64_t b = task * kElementsPerTask;
    std::memset(p + b, 0, std::min(kElementsPerTask, n - b) * sizeof(float));
  });
  return out;
}

// A pool thread's buffers for its experts' matrices, kept across experts and calls:
// fresh at::empty tensors of a few hundred KiB were fresh mmaps, and zeroing their pages
// took a fifth of the backward (perf: clear_page_erms). Each Mat is a slot: a task takes
// different slots for the matrices it holds at once.
struct TaskScratch {
  runtime::AlignedVector<float> mats[10];
  runtime::AlignedVector<float> panel;
  runtime::AlignedVector<uint16_t> rows16[3];   // bf16 rows: of the products with the base; x's
  runtime::AlignedVector<uint16_t> panel16[2];  // bf16 VNNI panels (a split one's hi, lo)
  runtime::AlignedVector<uint32_t> pairs[2];    // bf16 rows packed as kt_ops' tiles
};
TaskScratch& task_scratch() {
  thread_local TaskScratch s;
  return s;
}
// Above this many floats in one slot the memory goes back after the call.
constexpr size_t kKeepScratchFloats = size_t{4} << 20;  // 16 MiB

at::Tensor scratch_mat(int slot, int64_t rows, int64_t cols) {
  runtime::AlignedVector<float>& v = task_scratch().mats[slot];
  const size_t need = static_cast<size_t>(rows * cols);
  if (v.size() < need) v.resize(need);
  return view(v.data(), {rows, cols});
}

void trim_task_scratch() {
  TaskScratch& s = task_scratch();
  for (auto& v : s.mats)
    if (v.size() > kKeepScratchFloats) std::remove_reference_t<decltype(v)>().swap(v);
  for (auto& v : s.rows16)
    if (v.size() > 2 * kKeepScratchFloats) std::remove_reference_t<decltype(v)>().swap(v);
  for (auto& v : s.pairs)
    if (v.size() > kKeepScratchFloats) std::remove_reference_t<decltype(v)>().swap(v);
}

// m rows of n bf16 values in a pool thread's kept buffer `slot`, kernels::tile_rows_ld(n)
// apart (rows 4 KiB apart, n = 2048, would share one L1 set in the tile kernels).
uint16_t* scratch_rows16(int slot, int64_t m, int64_t n) {
  runtime::AlignedVector<uint16_t>& v = task_scratch().rows16[slot];
  const size_t need = static_cast<size_t>(m * kernels::tile_rows_ld(n));
  if (v.size() < need) v.resize(need);
  return v.data();
}

// Whether the backward's products with the base (go Wd, dg Wg + du Wu) run on bf16
// products (kt_ops' vdpbf16ps kernel or oneDNN's brgemm, kernels::brgemm::bf16_gemm)
// instead of fp32 BLAS: bf16 hidden states and output gradient, n and k of every
// projection multiples of 16, on a tier that runs the bf16 tile kernels. go Wd then stays
// exact on a bf16 base (bf16 go times bf16 weights: products exact in fp32, fp32 sums),
// so the gate/up LoRA gradients keep fp32 accuracy; dg and du are rounded to bf16 for dx,
// whose bf16 result (the dtype of x) carries about that rounding anyway. On int8 the
// panels hold the codes' exact bf16 values and the channel scales move onto the A rows:
// for dx into dg, du before their rounding; for go Wd (scales along its reduction)
// go * s is split into two bf16 rows, hi + lo, within 2^-17 of it (two calls on one
// panel). fp8_channel likewise; fp8 (128x128 block scales) keeps them off the rows: kt_ops'
// kernel scales each 128-row chunk's fp32 sums (fp8_chunk_scales), so go Wd stays exact
// as on bf16; mxfp4's values (power-of-two scales on E2M1) are bf16 values, in its panels
// as mxfp8's. Every other format (int4, k-quants, nvfp4, q8_0, q4_0: values s * q - z
// that are not bf16 values) splits the weights instead (split_vnni_panel): go Wd
// on W_hi + W_lo (within 2^-17 of W: the LoRA gradients keep about fp32 accuracy), dx on
// W_hi (W rounded to bf16 as dg and du are: x's bf16 gradient moves by about one more
// rounding).
// How a projection's panels are made: its exact values (bf16_vnni_panel) or the split
// hi + lo of its fp32 values (split_vnni_panel).
bool exact_panels(const Projection& p) { return bf16_vnni_panel_applies(p); }
// The per-channel scales the caller folds into the rows of a product with p's exact
// panels (int8, fp8_channel), else nullptr (a split panel holds the scaled values).
const float* panel_scales(const Projection& p, int64_t e) {
  return exact_panels(p) ? channel_scales(p, e) : nullptr;
}

bool backward_on_brgemm(const at::Tensor& x, const at::Tensor& grad_output, const MoeLayer& w) {
  static const kernels::Isa avx512 = [] {
    try {
      return kernels::parse_isa("avx512");
    } catch (const std::exception&) {  // a build without the AVX-512 tiers
      return std::numeric_limits<kernels::Isa>::max();
    }
  }();
  // fp8's 128x128 block scales are applied per 128-row chunk of the sums: kt_ops'
  // kernel only (oneDNN's brgemm would need a call per chunk).
  bool chunked = false, panels = true;
  for (const Projection* p : {&w.gate, &w.up, &w.down}) {
    chunked = chunked || fp8_block_scaled(*p);
    panels = panels && (exact_panels(*p) || split_vnni_panel_applies(*p));
  }
  return x.scalar_type() == at::kBFloat16 && grad_output.scalar_type() == at::kBFloat16 && panels &&
         kernels::active_isa() >= avx512 && kernels::brgemm::bf16_runs() &&
         (!chunked || backward_on_kt_kernel());
}

// Output columns per panel of the backward: a [n/2][64][2] bf16 panel of the weights
// (256 KiB at n = 2048) stays in L2 while the expert's rows stream past it.
constexpr int64_t kVnniCols = 64;

// Whether the backward's products with the base run on kt_ops' own vdpbf16ps kernel
// (kernels::avx512::bf16_dp_panel) rather than oneDNN's brgemm: where the forward's bf16
// tiles are kt_ops' (AVX512_BF16 without AMX, or forced by brgemm_bf16_kernel = 'kt').
// Its gain is the weight stream: while it multiplies one panel it prefetches the next
// panel's source lines to L2, so the panel is built from L2, not from DRAM. With
// oneDNN's brgemm (which cannot interleave those loads) the build waited on DRAM, 30%
// of the backward at T = 512; on Zen 4 (Qwen3-30B-A3B layer, 2 threads) the backward
// takes 163-167 ms here against 196 on oneDNN (220 without the prefetch).
}  // namespace

bool backward_on_kt_kernel() {
  return kernels::brgemm::kt_bf16_runs() && kernels::avx512::bf16_dp_panel != nullptr &&
         kernels::avx512::pack_pair_tiles != nullptr;
}

namespace {

// Which panel of a projection a product reads: its exact values, or the hi / lo part
// of split ones (split_vnni_panel).
enum class Part { kValues, kHi, kLo };

// One term a [m, n] @ W of vnni_products: bf16 rows kernels::tile_rows_ld(n) apart
// (scratch_rows16), times `part` of projection p.
struct PanelTerm {
  const uint16_t* rows;
  const Projection* p;
  Part part;
};

// out [m, k] fp32 (row stride k) = sum_j a_j @ W_j for expert e's projections W_j (one n
// and k), per 64-column VNNI panel; a projection's panel (or both parts of a split one)
// is made once per column range for all its terms. On kt_ops' kernel each distinct a_j
// is packed once as its row tiles, the panel is four 16-column slices [n/2][16][2], and
// the source of the next panel (or of `then`'s first one: the caller's next product) is
// prefetched during each; the terms add in order through out. On oneDNN's brgemm, one
// [n/2][64][2] panel per call. Where p keeps backward panels (moe/backward_panels.h) of
// a width the kernel reads, they are read instead of made: kt_ops' 16-wide slices;
// oneDNN's 64-wide panels (one call) or 16-wide ones (four calls).
void vnni_products(std::initializer_list<PanelTerm> terms, int64_t m, int64_t e, float* out,
                   const Projection* then = nullptr) {
  const Projection& p0 = *terms.begin()->p;
  const int64_t n = p0.n, k = p0.k, kp = n / 2, lda = kernels::tile_rows_ld(n);
  const bool kt = backward_on_kt_kernel();
  TaskScratch& scratch = task_scratch();
  for (runtime::AlignedVector<uint16_t>& v : scratch.panel16)
    if (v.size() < static_cast<size_t>(n * kVnniCols)) v.resize(n * kVnniCols);
  const PanelTerm* first = terms.begin();
  const int64_t count = static_cast<int64_t>(terms.size());
  // kt_ops' kernel: each distinct a_j packed once as its row tiles of k pairs.
  int64_t slot_of[4] = {0, 0, 0, 0};
  TORCH_INTERNAL_ASSERT(count <= 4);
  if (kt) {
    int slot = 0;
    for (int64_t j = 0; j < count; ++j) {
      int64_t same = j;
      for (int64_t i = 0; i < j; ++i)
        if (first[i].rows == first[j].rows) same = i;
      if (same != j) {
        slot_of[j] = slot_of[same];
        continue;
      }
      TORCH_INTERNAL_ASSERT(slot < 2, "vnni_products: at most two distinct row sets");
      slot_of[j] = slot;
      runtime::AlignedVector<uint32_t>& v = scratch.pairs[slot++];
      if (v.size() < static_cast<size_t>(m * kp)) v.resize(static_cast<size_t>(m * kp));
      kernels::avx512::pack_pair_tiles(first[j].rows, lda, static_cast<int>(m),
                                       static_cast<int>(kp), v.data());
    }
  }
  // Whether a split projection's lo part is read by any term (else hi alone is made).
  auto wants_lo = [&](const Projection* p) {
    for (int64_t i = 0; i < count; ++i)
      if (first[i].p == p && first[i].part == Part::kLo) return true;
    return false;
  };
  // The panel built after term j's at column c0 (a later term's projection, else the
  // first term's next columns, else `then`'s first), whose weights kt_ops' kernel
  // prefetches while it multiplies; {nullptr, 0}: none.
  auto next_panel = [&](int64_t j, int64_t c0) -> std::pair<const Projection*, int64_t> {
    for (int64_t i = j + 1; i < count; ++i)
      if (first[i].p != first[j].p) return {first[i].p, c0};
    if (c0 + kVnniCols < k) return {first[0].p, c0 + kVnniCols};
    return {then, 0};
  };
  // Columns [c0, c0 + cols) of p into the panels: the values or hi into panel16[0], lo
  // into panel16[1]; slices of 16 columns [n/2][16][2] (kt_ops) or one [n/2][cols][2].
  auto make_panel = [&](const Projection& p, int64_t c0, int64_t cols) {
    const int64_t step = kt ? 16 : cols;
    if (!exact_panels(p)) {  // one call for all the slices (a block's tables once per group)
      split_vnni_panel(p, e, c0, cols, scratch.panel16[0].data(),
                       wants_lo(&p) ? scratch.panel16[1].data() : nullptr, step);
      return;
    }
    for (int64_t s = 0; s < cols; s += step)
      bf16_vnni_panel(p, e, c0 + s, step, scratch.panel16[0].data() + s * n);
  };
  // The projection's kept backward panel at column c0 where this kernel reads them (kt_ops':
  // 16 columns wide, its slices; oneDNN's: any width), else nullptr.
  auto kept = [&](const Projection& p, int64_t c0) -> const uint16_t* {
    if (kt && backward_panel_width(p) != kPanelWidthKt) return nullptr;
    return backward_panel_slice(p, e, c0);
  };
  for (int64_t c0 = 0; c0 < k; c0 += kVnniCols) {
    const int64_t cols = std::min(kVnniCols, k - c0);
    const Projection* made = nullptr;  // the projection whose panel is in panel16
    for (int64_t j = 0; j < count; ++j) {
      const PanelTerm& t = first[j];
      const bool add = j > 0;
      const uint16_t* panel = kept(*t.p, c0);
      // oneDNN: one call per panel, [n/2][width][2] (kept, 16 or 64 wide) or the
      // [n/2][cols][2] one made here.
      const int64_t width = panel != nullptr ? backward_panel_width(*t.p) : cols;
      if (panel == nullptr) {
        if (t.p != made) make_panel(*t.p, c0, cols);
        made = t.p;
        panel = scratch.panel16[t.part == Part::kLo ? 1 : 0].data();
      }
      if (!kt) {
        for (int64_t s = 0; s < cols; s += width)
          kernels::brgemm::bf16_gemm(static_cast<int>(m), width, n, t.rows, lda, panel + s * n,
                                     out + c0 + s, k, add);
        continue;
      }
      // kt_ops: 16-column slices [n/2][16][2], the next panel's weights prefetched.
      const auto [np, nc0] = next_panel(j, c0);
      for (int64_t s = 0; s < cols; s += 16) {
        kernels::PrefetchChunks pf;
        if (np != nullptr && nc0 + s < np->k) {
          const uint16_t* next = kept(*np, nc0 + s);
          pf = next != nullptr ? backward_panel_prefetch(next, np->n)
                               : vnni_panel_source(*np, e, nc0 + s);
        }
        kernels::avx512::bf16_dp_panel(scratch.pairs[slot_of[j]].data(), static_cast<int>(m),
                                       panel + s * n, static_cast<int>(kp), out + c0 + s, k, add,
                                       pf, fp8_chunk_scales(*t.p, e, c0 + s));
      }
    }
  }
}

// dst [m, n] bf16 (round to nearest even; rows ldd apart) of src [m, n] fp32, each column j
// times scales[j] first where scales is not null (an int8 projection's channel scales).
void to_bf16_rows(const float* src, int64_t m, int64_t n, const float* scales, uint16_t* dst,
                  int64_t ldd) {
  for (int64_t i = 0; i < m; ++i) {
    const float* r = src + i * n;
    uint16_t* d = dst + i * ldd;
    if (scales == nullptr) {
      for (int64_t j = 0; j < n; ++j) d[j] = c10::BFloat16(r[j]).x;
    } else {
      for (int64_t j = 0; j < n; ++j) d[j] = c10::BFloat16(r[j] * scales[j]).x;
    }
  }
}

// h[0, n) = glu(g, u): the tier's vector epilogue over lines of 16, the scalar form
// for the tail. h may be g itself.
void glu_values(kernels::GluRows rows, const float* g, const float* u, int64_t n,
                const kernels::Glu& glu, float* h) {
  if (h != g) std::memcpy(h, g, n * sizeof(float));
  const int64_t lines = n / 16;
  rows(h, u, static_cast<int>(lines), glu);
  for (int64_t i = lines * 16; i < n; ++i) h[i] = kernels::glu_value(glu, h[i], u[i]);
}

// Whether the forward may run on the inference driver with its tile path: bf16 hidden
// states on a bf16 base. The gate and up products are then exact (bf16 products fit
// fp32, the sums are fp32: vdpbf16ps, AMX and oneDNN's brgemm accumulate in fp32), so
// the saved pre-activations, hence the LoRA gradients, keep fp32 accuracy; the down
// projection's tile kernel reads h rounded to bf16, as inference does: the output (bf16,
// as x is) moves by about its own rounding, and the down LoRA term reads the fp32 h.
// An int8 (per channel) base with bf16 hidden states takes the same tile path forced
// ('brgemm': under quant 'fp32' its kernel is avx512_bf16/qint_dp_exact where kt_ops'
// bf16 tiles run, else onednn/brgemm_int8_bf16: codes decoded to their exact bf16
// values, the channel scales on the outputs): as exact, and 1.7x
// faster than the streaming fp32 path at T = 512 (its own threshold under 'auto' is
// the int8 row's, none on AVX-512). fp8, fp8_channel and mxfp8 bases likewise, on the
// tiles that keep their products exact (kernels::brgemm::fp8_tiles_exact: bf16(x)
// times the exact E4M3 values, the scales applied to fp32 sums or exactly in the
// decode; kt_ops' tiles on AVX512_BF16 + VBMI without AMX). The other qint bases (int4,
// the k-quants, q8_0, q4_0, mxfp4, nvfp4) on kt_ops' exact qint tiles (AVX512_BF16:
// bf16(x) times the codes' exact values, each group's fp32 sums times its scales, minus
// its zeros times the group's x sum; kernels::brgemm::qint_tiles_exact): 1.5-1.9x
// faster than streaming at T = 512 (kernels/avx512/qint_dp_avx512bf16.cpp); mxfp4 on
// oneDNN's exact kernel first where oneDNN computes bf16 (kernels::brgemm::mxfp4_dot).
// Anything else runs the streaming kernels with fp32 activations (no rounding at all).
kernels::ComputePath lora_forward_path(const at::Tensor& x, const MoeLayer& w) {
  if (x.scalar_type() != at::kBFloat16) return kernels::ComputePath::kStreaming;
  bool all_bf16 = true, exact_tiles = true;
  for (const Projection* p : {&w.gate, &w.up, &w.down}) {
    const bool bf16 = p->format->layout == formats::Layout::kBf16;
    all_bf16 = all_bf16 && bf16;
    exact_tiles = exact_tiles && (bf16 || kernels::brgemm::int8_per_channel_applies(*p->format) ||
                                  kernels::brgemm::fp8_tiles_exact(*p->format) ||
                                  kernels::brgemm::qint_tiles_exact(*p->format));
  }
  if (all_bf16) return kernels::ComputePath::kAuto;
  return exact_tiles ? kernels::ComputePath::kBrgemm : kernels::ComputePath::kStreaming;
}

}  // namespace

namespace {

std::atomic<uint64_t> g_lora_f32_calls{0};

// Row stride of a factor's copy: k, plus one 64-byte line where rows k floats apart would
// be a multiple of 2 KiB apart (all in one or two of the L1's 64 sets).
int64_t padded_ld(int64_t k) { return k % 512 == 0 ? k + 16 : k; }

// A thread's copy of one factor of one expert: 2 per projection (A, B^T).
struct FactorCopy {
  uint64_t call = 0;
  int64_t e = -1;
  runtime::AlignedVector<float> rows;
};
FactorCopy& factor_copy(int slot) {
  thread_local FactorCopy t_copies[6];
  return t_copies[slot];
}

// Rows of the LoRA products below which A is read where it is (a copy costs more).
constexpr int64_t kCopyAMinRows = 16;

// Values [first, first + n) of a LoRA factor (fp32, bf16 or fp16) as fp32 into dst.
void factor_to_f32(const void* p, at::ScalarType dtype, int64_t first, int64_t n, float* dst) {
  if (dtype == at::kFloat) {
    std::memcpy(dst, static_cast<const float*>(p) + first, n * 4);
  } else if (dtype == at::kBFloat16) {
    to_f32_range(static_cast<const c10::BFloat16*>(p) + first, dst, n);
  } else {
    to_f32_range(static_cast<const c10::Half*>(p) + first, dst, n);
  }
}

// Rows [i0, i0 + rows) of B[e] [n, r] as columns of dst (rows ld apart): transpose_rows
// of fp32 B where it is, of bf16 / fp16 B's rows (contiguous) widened first into the
// calling thread's buffer.
void b_columns(const LoraF32& f, int64_t e, int64_t i0, int64_t rows, float* dst, int64_t ld) {
  const int64_t first = (e * f.n + i0) * f.r;
  if (f.dtype == at::kFloat) {
    transpose_rows(static_cast<const float*>(f.b) + first, rows, f.r, dst, ld);
    return;
  }
  thread_local std::vector<float> t_wide;
  if (t_wide.size() < static_cast<size_t>(rows * f.r))
    t_wide.resize(static_cast<size_t>(rows * f.r));
  factor_to_f32(f.b, f.dtype, first, rows * f.r, t_wide.data());
  transpose_rows(t_wide.data(), rows, f.r, dst, ld);
}

}  // namespace

LoraRows LoraF32::a_rows(int64_t e, int64_t m) const {
  const int64_t ld = m < kCopyAMinRows ? k : padded_ld(k);
  const int64_t first = e * r * k;
  if (dtype == at::kFloat && ld == k) return {static_cast<const float*>(a) + first, k};
  FactorCopy& c = factor_copy(2 * id);
  if (c.call != call || c.e != e) {
    if (c.rows.size() < static_cast<size_t>(r * ld)) c.rows.resize(static_cast<size_t>(r * ld));
    for (int64_t j = 0; j < r; ++j)
      factor_to_f32(a, dtype, first + j * k, k, c.rows.data() + j * ld);
    c.call = call;
    c.e = e;
  }
  return {c.rows.data(), ld};
}

LoraRows LoraF32::bt_rows(int64_t e) const {
  const int64_t ld = padded_ld(n);
  FactorCopy& c = factor_copy(2 * id + 1);
  if (c.call != call || c.e != e) {
    if (c.rows.size() < static_cast<size_t>(r * ld)) c.rows.resize(static_cast<size_t>(r * ld));
    b_columns(*this, e, 0, n, c.rows.data(), ld);
    c.call = call;
    c.e = e;
  }
  return {c.rows.data(), ld};
}

LoraRows LoraF32::bt_block(int64_t e, int64_t nb, int n_valid) const {
  constexpr int64_t kRows = formats::kBf16BlockRows;
  thread_local std::vector<float> t_strip;
  if (t_strip.size() < static_cast<size_t>(r * kRows))
    t_strip.resize(static_cast<size_t>(r * kRows));
  // Columns past n_valid zero (the block's last rows of a projection whose n is not a
  // multiple of 16); the others are all written below.
  if (n_valid < kRows) std::fill(t_strip.begin(), t_strip.end(), 0.f);
  b_columns(*this, e, nb * kRows, n_valid, t_strip.data(), kRows);
  return {t_strip.data(), kRows};
}

LoraF32 lora_f32(const LoraProjection& p, int id) {
  LoraF32 f;
  if (!p.present()) return f;
  f.a = p.a.data_ptr();
  f.b = p.b.data_ptr();
  f.dtype = p.a.scalar_type();  // B's too (one dtype, contiguous: parse_moe_layer)
  f.r = p.a.size(1);
  f.k = p.a.size(2);
  f.n = p.b.size(1);
  f.id = id;
  f.call = ++g_lora_f32_calls;
  return f;
}

LoraForwardResult moe_forward_lora(const at::Tensor& x, const at::Tensor& topk_ids,
                                   const at::Tensor& topk_weights, const MoeLayer& w,
                                   bool save_pre) {
  const int64_t T = x.size(0), K = topk_ids.size(1), I = w.intermediate_size;
  LoraForwardResult res;
  res.out = at::empty(x.sizes(), x.options());
  // The driver writes every row (zero for the slots without an expert).
  at::Tensor gate_pre = at::empty({T * K, I}, kF32), up_pre = at::empty({T * K, I}, kF32);
  moe_forward_experts_exact(x, topk_ids, topk_weights, w, kernels::active_isa(), &res.out, gate_pre,
                            up_pre, lora_forward_path(x, w));
  if (save_pre) {
    res.gate_pre = gate_pre;
    res.up_pre = up_pre;
  }
  return res;
}

namespace {

// A saved pre-activation: fp32 [T*K, I], contiguous, on the CPU.
void check_pre(const at::Tensor& t, const char* name, int64_t rows, int64_t I) {
  TORCH_CHECK(shape_only() || t.device().is_cpu(), "kt.moe_backward: ", name, " is on ", t.device(),
              "; it must be the CPU tensor that kt.moe_forward_train returned");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == I && t.is_contiguous(),
              "kt.moe_backward: ", name, " must be a contiguous fp32 [T*K=", rows, ", I=", I,
              "] tensor as returned by kt.moe_forward_train, got ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace

void check_backward_args(int64_t intermediate_size, const at::Tensor& grad_output,
                         const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const std::optional<at::Tensor>& gate_pre,
                         const std::optional<at::Tensor>& up_pre) {
  TORCH_CHECK(shape_only() || grad_output.device().is_cpu(), "kt.moe_backward: grad_output is on ",
              grad_output.device(), "; the kt_ops experts run on the CPU");
  TORCH_CHECK(grad_output.sizes() == hidden_states.sizes(),
              "kt.moe_backward: grad_output must have the shape of hidden_states ",
              hidden_states.sizes(), ", got ", grad_output.sizes());
  TORCH_CHECK(
      grad_output.scalar_type() == at::kFloat || grad_output.scalar_type() == at::kBFloat16 ||
          grad_output.scalar_type() == at::kHalf,
      "kt.moe_backward: grad_output must be fp32, bf16 or fp16, got ", grad_output.scalar_type());
  TORCH_CHECK(gate_pre.has_value() == up_pre.has_value(),
              "kt.moe_backward: ", gate_pre.has_value() ? "gate_pre" : "up_pre",
              " was given without ", gate_pre.has_value() ? "up_pre" : "gate_pre",
              "; pass both saved pre-activations of kt.moe_forward_train (or neither)");
  const int64_t rows = topk_ids.size(0) * topk_ids.size(1);
  if (gate_pre.has_value()) {
    check_pre(*gate_pre, "gate_pre", rows, intermediate_size);
    check_pre(*up_pre, "up_pre", rows, intermediate_size);
  }
}

MoeGrads moe_backward_lora(const at::Tensor& grad_output, const at::Tensor& x,
                           const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const MoeLayer& w, const at::Tensor& saved_gate_pre,
                           const at::Tensor& saved_up_pre, bool compute_grad_x) {
  // Without saved pre-activations (activation checkpointing) the exact forward
  // recomputes them: the same bits as a forward that saved them.
  at::Tensor gate_pre = saved_gate_pre, up_pre = saved_up_pre;
  if (!gate_pre.defined() && x.size(0) > 0) {
    const int64_t rows = x.size(0) * topk_ids.size(1);
    gate_pre = at::empty({rows, w.intermediate_size}, kF32);
    up_pre = at::empty({rows, w.intermediate_size}, kF32);
    moe_forward_experts_exact(x.contiguous(), topk_ids, topk_weights, w, kernels::active_isa(),
                              nullptr, gate_pre, up_pre, lora_forward_path(x, w));
  }
  const LoraParams& lora = w.lora;
  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1);
  const int64_t E = w.gate.num_experts(), I = w.gate.n;
  const bool shared_a = lora.shares_gate_up_a();
  const LoraF32 lg = lora_f32(lora.gate, 0);
  const LoraF32 lu = lora_f32(lora.up, 1);
  const LoraF32 ld = lora_f32(lora.down, 2);
  const kernels::GluRows glu = kernels::glu_rows(kernels::active_isa(), w.glu);
  const kernels::GluBackwardRows glu_back =
      kernels::glu_backward_rows(kernels::active_isa(), w.glu);
  const float s = static_cast<float>(lora.scaling);

  // fp32 accumulators; experts without tokens keep zero LoRA gradients.
  at::Tensor grad_w = at::zeros({T, K}, kF32);
  auto lora_grads = [&](const LoraF32& l) {
    return l.present() ? std::make_pair(zeros_on_pool({E, l.r, l.k}), zeros_on_pool({E, l.n, l.r}))
                       : std::make_pair(at::Tensor(), at::Tensor());
  };
  // Plain variables, not structured bindings: the expert lambda captures them (C++17).
  at::Tensor ga_g, gb_g, ga_u, gb_u, ga_d, gb_d;
  std::tie(ga_g, gb_g) = lora_grads(lg);
  std::tie(ga_u, gb_u) = lora_grads(lu);
  std::tie(ga_d, gb_d) = lora_grads(ld);
  at::Tensor grad_x;
  if (compute_grad_x) grad_x = at::empty({T, H}, x.options());

  if (T > 0 && H > 0) {
    RoutingPlan plan;
    build_routing_plan(w.op, topk_ids, topk_weights, E, w.skip_mask(), plan);
    // bf16 x and output gradient: the LoRA products read their bf16 rows (widened exactly
    // on load: the same results), not fp32 copies (8 KiB a row at H = 2048, made and
    // gathered; their copies were 4% of the step on Zen 4).
    const bool rows16 = x.scalar_type() == at::kBFloat16 &&
                        grad_output.scalar_type() == at::kBFloat16 && lora_products::own_kernels();
    const at::Tensor xf = rows16 ? at::Tensor() : f32_on_pool(x);
    const at::Tensor gof = rows16 ? at::Tensor() : f32_on_pool(grad_output);
    const at::Tensor x16 = rows16 ? x.contiguous() : at::Tensor();
    const bool on_brgemm = backward_on_brgemm(x, grad_output, w);
    const at::Tensor go16 = on_brgemm || rows16 ? grad_output.contiguous() : at::Tensor();
    const auto* go16p = go16.defined() ? static_cast<const uint16_t*>(go16.data_ptr()) : nullptr;
    const auto* x16p = rows16 ? static_cast<const uint16_t*>(x16.data_ptr()) : nullptr;
    const float* xp = rows16 ? nullptr : xf.data_ptr<float>();
    const float* gop = rows16 ? nullptr : gof.data_ptr<float>();
    const float* gpre = gate_pre.data_ptr<float>();
    const float* upre = up_pre.data_ptr<float>();
    // x's gradient per slot [T*K, H] (134 MB at T = 2048 on a Qwen3-30B-A3B layer): in a
    // buffer the calling thread keeps (up to scratch_keep_bytes()), not fresh pages per call.
    thread_local std::vector<float> t_dx_slots;
    float* dxp = nullptr;
    if (compute_grad_x) {
      const size_t n = static_cast<size_t>(T * K * H);
      if (t_dx_slots.size() < n) t_dx_slots.resize(n);
      dxp = t_dx_slots.data();
    }
    float* gwp = grad_w.data_ptr<float>();

    const std::vector<int64_t> order = experts_by_load(plan);
    run_blas_tasks(static_cast<int64_t>(order.size()), [&](int64_t task, int) {
      const int64_t e = order[task];
      const int64_t r0 = plan.expert_offsets[e];
      const int64_t m = plan.expert_offsets[e + 1] - r0;
      const int64_t* slot = plan.row_slot.data() + r0;
      const int64_t* token = plan.row_token.data() + r0;
      const float* rw = plan.row_weight.data() + r0;
      runtime::AlignedVector<float>& panel = task_scratch().panel;
      // The panels' values exact for this expert (mxfp8's exponents in bf16's range).
      const bool panels = on_brgemm && panel_values_exact(w.gate, e) &&
                          panel_values_exact(w.up, e) && panel_values_exact(w.down, e);

      // The expert's rows of x: fp32 (xep) or bf16 (xe16, rows H apart).
      const float* xep = nullptr;
      uint16_t* xe16 = nullptr;
      if (rows16) {
        xe16 = scratch_rows16(2, m, H);
        gather_rows(x16p, m, H, token, xe16);
      } else {
        at::Tensor xe = scratch_mat(0, m, H);
        gather_rows(xp, m, H, token, xe.data_ptr<float>());
        xep = xe.data_ptr<float>();
      }
      at::Tensor g = scratch_mat(1, m, I), u = scratch_mat(2, m, I);
      at::Tensor xa_g, xa_u;  // x A^T of gate / up, for the B gradients
      gather_rows(gpre, m, I, slot, g.data_ptr<float>());
      gather_rows(upre, m, I, slot, u.data_ptr<float>());
      // src [m, k] (rows k apart) a^T, for a factor's rows a: [m, r].
      auto xat = [&](const float* src, int64_t k, LoraRows a, int64_t r) {
        at::Tensor y = at::empty({m, r}, kF32);
        lora_products::xat(src, k, m, k, a.p, a.ld, r, y.data_ptr<float>());
        return y;
      };
      // The same on bf16 rows ld apart.
      std::vector<const uint16_t*> row_ptrs(static_cast<size_t>(m));
      auto xat16 = [&](const uint16_t* src, int64_t ld, int64_t k, LoraRows a, int64_t r) {
        at::Tensor y = at::empty({m, r}, kF32);
        for (int64_t i = 0; i < m; ++i) row_ptrs[i] = src + i * ld;
        lora_products::xat_rows_bf16(row_ptrs.data(), m, k, a.p, a.ld, r, y.data_ptr<float>());
        return y;
      };
      auto x_at = [&](LoraRows a, int64_t r) {
        return rows16 ? xat16(xe16, H, H, a, r) : xat(xep, H, a, r);
      };
      if (lg.present()) xa_g = x_at(lg.a_rows(e, m), lg.r);
      if (lu.present()) xa_u = shared_a ? xa_g : x_at(lu.a_rows(e, m), lu.r);
      float* gp = g.data_ptr<float>();
      float* up = u.data_ptr<float>();
      at::Tensor h = scratch_mat(3, m, I);
      float* hp = h.data_ptr<float>();
      glu_values(glu, gp, up, m * I, w.glu, hp);

      // dh_u = dL/dh before the routing weight: go Wd + s (go Bd) Ad.
      const float* sd = panel_scales(w.down, e);
      const float* bd = w.down.bias_row(e);
      // go's rows as bf16 (go_rows, rows ldr apart) where the product with the base reads
      // them so and x is bf16 too; fp32 (go) where anything else reads them.
      uint16_t* go_rows = panels ? scratch_rows16(0, m, H) : nullptr;
      const int64_t ldr = kernels::tile_rows_ld(H);
      const bool go_rows16 = rows16 && panels && sd == nullptr;
      at::Tensor go;
      if (!go_rows16 || bd != nullptr) {
        go = scratch_mat(4, m, H);
        float* gor = go.data_ptr<float>();
        if (rows16) {
          const auto* go_bf16 = reinterpret_cast<const c10::BFloat16*>(go16p);
          for (int64_t i = 0; i < m; ++i) to_f32_range(go_bf16 + token[i] * H, gor + i * H, H);
        } else {
          gather_rows(gop, m, H, token, gor);
        }
      }
      at::Tensor dh = scratch_mat(5, m, I);
      if (panels) {
        const Projection* then_dx = compute_grad_x ? &w.gate : nullptr;  // the next product
        if (sd == nullptr) {
          gather_rows(go16p, m, H, token, go_rows, ldr);
          // A split down projection: go (W_hi + W_lo), go's rows packed once.
          if (exact_panels(w.down)) {
            vnni_products({{go_rows, &w.down, Part::kValues}}, m, e, dh.data_ptr<float>(), then_dx);
          } else {
            vnni_products({{go_rows, &w.down, Part::kHi}, {go_rows, &w.down, Part::kLo}}, m, e,
                          dh.data_ptr<float>(), then_dx);
          }
        } else {  // int8: go * s = hi + lo, both bf16 (the scales run along the reduction)
          uint16_t* lo_rows = scratch_rows16(1, m, H);
          const float* gor = go.data_ptr<float>();
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < H; ++j) {
              const float v = gor[i * H + j] * sd[j];
              const c10::BFloat16 hi(v);
              go_rows[i * ldr + j] = hi.x;
              lo_rows[i * ldr + j] = c10::BFloat16(v - static_cast<float>(hi)).x;
            }
          }
          vnni_products({{go_rows, &w.down, Part::kValues}, {lo_rows, &w.down, Part::kValues}}, m,
                        e, dh.data_ptr<float>(), then_dx);
        }
      } else {
        base_products({{&go, &w.down}}, e, dh, panel);
      }
      at::Tensor go_b;  // go Bd [m, rd]
      if (ld.present()) {
        go_b = go_rows16 ? xat16(go_rows, ldr, H, ld.bt_rows(e), ld.r)
                         : xat(go.data_ptr<float>(), H, ld.bt_rows(e), ld.r);
        const LoraRows ad = ld.a_rows(e, m);
        lora_products::tw(go_b.data_ptr<float>(), m, ld.r, ad.p, ad.ld, I, s, true,
                          dh.data_ptr<float>(), I);
      }
      // d out[t] / d w[t, k] = <go, y> = <dh_u, h> (+ <go, bd> with a down bias).
      float* dhp = dh.data_ptr<float>();
      const float* gorow = go.defined() ? go.data_ptr<float>() : nullptr;
      for (int64_t i = 0; i < m; ++i) {
        float dot = dot_lanes(dhp + i * I, hp + i * I, I);
        if (bd != nullptr) dot += dot_lanes(gorow + i * H, bd, H);
        gwp[slot[i]] = dot;
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < I; ++j) dhp[i * I + j] *= rw[i];
      }
      if (ld.present()) {
        // dBd = s go^T (w * (h Ad^T)), dAd = s (w * go Bd)^T h.
        at::Tensor ha = xat(hp, I, ld.a_rows(e, m), ld.r);
        float* hap = ha.data_ptr<float>();
        float* gbp = go_b.data_ptr<float>();
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < ld.r; ++j) {
            hap[i * ld.r + j] *= rw[i];
            gbp[i * ld.r + j] *= rw[i];
          }
        }
        // dBd [H, rd] = s go^T ha, made as s ha^T go [rd, H] and transposed.
        float* gbt = scratch_mat(7, ld.r, H).data_ptr<float>();
        if (go_rows16)
          lora_products::dtx_bf16(hap, ld.r, m, ld.r, go_rows, ldr, H, s, gbt, H);
        else
          lora_products::dtx(hap, ld.r, m, ld.r, go.data_ptr<float>(), H, H, s, gbt, H);
        transpose_into(gbt, ld.r, H, gb_d.data_ptr<float>() + e * H * ld.r);
        lora_products::dtx(gbp, ld.r, m, ld.r, hp, I, I, s, ga_d.data_ptr<float>() + e * ld.r * I,
                           I);
      }

      // dg = dh * u * act'(g), du = dh * act(g); written over g and u.
      const int64_t vec = glu_back != nullptr ? m * I / 16 * 16 : 0;
      if (vec > 0) glu_back(gp, up, dhp, vec / 16);
      for (int64_t i = vec; i < m * I; ++i)
        kernels::glu_backward(w.glu, gp[i], up[i], dhp[i], &gp[i], &up[i]);
      const at::Tensor& dg = g;
      const at::Tensor& du = u;
      // dB = s d^T (x A^T), dA = s (d B)^T x for the gate and up LoRA.
      auto input_lora_grads = [&](const LoraF32& l, const at::Tensor& d, const at::Tensor& xa,
                                  const at::Tensor& grad_a, const at::Tensor& grad_b) {
        if (!l.present()) return at::Tensor();
        const float* dp = d.data_ptr<float>();
        at::Tensor d_b = xat(dp, I, l.bt_rows(e), l.r);  // d B [m, r]
        // dB [I, r] = s d^T xa, made as s xa^T d [r, I] and transposed.
        float* gbt = scratch_mat(7, l.r, I).data_ptr<float>();
        lora_products::dtx(xa.data_ptr<float>(), l.r, m, l.r, dp, I, I, s, gbt, I);
        transpose_into(gbt, l.r, I, grad_b.data_ptr<float>() + e * I * l.r);
        float* ga = grad_a.data_ptr<float>() + e * l.r * H;
        if (rows16)
          lora_products::dtx_bf16(d_b.data_ptr<float>(), l.r, m, l.r, xe16, H, H, s, ga, H);
        else
          lora_products::dtx(d_b.data_ptr<float>(), l.r, m, l.r, xep, H, H, s, ga, H);
        return d_b;
      };
      const at::Tensor dg_b = input_lora_grads(lg, dg, xa_g, ga_g, gb_g);
      const at::Tensor du_b = input_lora_grads(lu, du, xa_u, ga_u, gb_u);
      if (compute_grad_x) {
        // dx = dg Wg + du Wu + s (dg Bg) Ag + s (du Bu) Au.
        at::Tensor dx = scratch_mat(6, m, H);
        if (panels) {
          uint16_t* dg16 = scratch_rows16(0, m, I);
          uint16_t* du16 = scratch_rows16(1, m, I);
          const int64_t ldr = kernels::tile_rows_ld(I);
          to_bf16_rows(dg.data_ptr<float>(), m, I, panel_scales(w.gate, e), dg16, ldr);
          to_bf16_rows(du.data_ptr<float>(), m, I, panel_scales(w.up, e), du16, ldr);
          const Part gate = exact_panels(w.gate) ? Part::kValues : Part::kHi;
          const Part up = exact_panels(w.up) ? Part::kValues : Part::kHi;
          vnni_products({{dg16, &w.gate, gate}, {du16, &w.up, up}}, m, e, dx.data_ptr<float>());
        } else {
          base_products({{&dg, &w.gate}, {&du, &w.up}}, e, dx, panel);
        }
        // + s (dg Bg) Ag + s (du Bu) Au, in one pass over dx's rows.
        float* dxe = dx.data_ptr<float>();
        std::vector<float*> dx_rows(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) dx_rows[i] = dxe + i * H;
        lora_products::TwTerm terms[2];
        int nterms = 0;
        for (const auto& [l, t] : {std::pair(&lg, &dg_b), std::pair(&lu, &du_b)}) {
          if (!l->present()) continue;
          const LoraRows a = l->a_rows(e, m);
          terms[nterms++] = {t->data_ptr<float>(), l->r, a.p, a.ld};
        }
        lora_products::tw_terms(terms, nterms, m, H, s, true, dx_rows.data());
        scatter_rows(dx.data_ptr<float>(), m, H, slot, dxp);
      }
      if (on_brgemm) kernels::brgemm::release();  // AMX: the tile configuration
    });
    runtime::ThreadPool::global().run(blas_task_threads(),
                                      [](int64_t, int) { trim_task_scratch(); });
    if (compute_grad_x) combine_slots(dxp, plan, H, grad_x);
    if (t_dx_slots.capacity() * sizeof(float) > scratch_keep_bytes()) {
      std::vector<float>().swap(t_dx_slots);
    }
  }

  MoeGrads grads;
  grads.hidden_states = grad_x;
  grads.topk_weights = grad_w.to(topk_weights.scalar_type());
  const auto cast = [](const at::Tensor& g, const LoraProjection& p) {
    return p.present() ? g.to(p.a.scalar_type()) : at::Tensor();
  };
  grads.gate_a = cast(ga_g, lora.gate);
  grads.gate_b = cast(gb_g, lora.gate);
  grads.up_a = cast(ga_u, lora.up);
  grads.up_b = cast(gb_u, lora.up);
  grads.down_a = cast(ga_d, lora.down);
  grads.down_b = cast(gb_d, lora.down);
  return grads;
}

}  // namespace kt::moe
