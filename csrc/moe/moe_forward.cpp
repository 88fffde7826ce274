#include "moe/moe_forward.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "formats/bf16.h"  // ceil_div
#include "formats/q8_activations.h"
#include "formats/qint.h"
#include "kernels/dispatch.h"
#include "kernels/plan.h"
#include "moe/blas_tasks.h"
#include "moe/lora_products.h"
#include "moe/moe_lora.h"
#include "moe/moe_phases.h"
#include "moe/routing.h"
#include "runtime/aligned_vector.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

namespace {

constexpr int kRows = formats::kQintBlockRows;  // output rows per block, every layout

// Per-calling-thread buffers, grown on demand and reused across calls: a
// decode step allocates nothing, and prefill does not fault in fresh pages.
struct Scratch {
  RoutingPlan routing;
  runtime::AlignedVector<float> x;  // [T][Hp] fp32 activations, zero padded
  std::vector<uint8_t> xq;          // [T] q8 records of x (where gate or up reads them)
  std::vector<uint16_t> xb;         // [T][Hp] bf16 activations (where gate or up reads them)
  runtime::AlignedVector<float> h;  // [R][Ip] GLU outputs, zero padded
  std::vector<uint8_t> hq;          // [R] q8 records of h (where down reads them)
  std::vector<uint16_t> hb;      // [R][tile_rows_ld(Ip)] bf16 GLU outputs (where down reads them)
  std::vector<float> y;          // [T*K][H] weighted expert outputs per slot
  std::vector<float> lora_t[3];  // [R][r] per plan row: x A^T of gate, of up; h Ad^T (LoRA)
  std::vector<const float*> x_rows;
  std::vector<const uint8_t*> xq_rows;
  std::vector<const float*> h_rows;
  std::vector<const uint8_t*> hq_rows;
  kernels::CallScratch kernels;  // the kernel families' scratch, per pool thread
};

thread_local Scratch t_scratch;

template <class T, class A>
size_t capacity_bytes(const std::vector<T, A>& v) {
  return v.capacity() * sizeof(T);
}

size_t scratch_bytes(const Scratch& s) {
  return capacity_bytes(s.x) + capacity_bytes(s.xq) + capacity_bytes(s.xb) + capacity_bytes(s.h) +
         capacity_bytes(s.hq) + capacity_bytes(s.hb) + capacity_bytes(s.y) +
         capacity_bytes(s.x_rows) + capacity_bytes(s.xq_rows) + capacity_bytes(s.h_rows) +
         capacity_bytes(s.hq_rows) + capacity_bytes(s.lora_t[0]) + capacity_bytes(s.lora_t[1]) +
         capacity_bytes(s.lora_t[2]) + s.kernels.bytes();
}

// The per-slot outputs y [T*K][H] in s.y, from its first 64-byte boundary (std::vector
// aligns to 16 bytes): with H a multiple of 16, every row's strips start a cache line, as
// down_block's non-temporal stores need.
inline float* y_rows(Scratch& s) {
  const auto p = reinterpret_cast<uintptr_t>(s.y.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
}

// Releases the calling thread's buffers when they hold more than scratch_keep_bytes().
void trim_scratch(Scratch& s) {
  if (scratch_bytes(s) <= scratch_keep_bytes()) return;
  Scratch empty;
  std::swap(s, empty);
}

// Per pool thread: one task's dot products [m][16] (gate and up; down reuses
// the first); grown once per thread.
thread_local std::vector<float> t_gate_out, t_up_out;

// bf16 bits of v, rounded to nearest even (c10::BFloat16's rounding; NaN stays NaN).
inline uint16_t to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                         : static_cast<uint16_t>(rounded);
}

void to_bf16_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = to_bf16(src[j]);
}

// A block row's n (<= 16) floats into dst: a whole strip as one fixed-size memcpy (SSE
// moves), not a libc memmove call per 64 bytes (the epilogues copy a strip per row and
// block: the calls were 1.3% of the LoRA forward on Zen 4), nor a loop, which GCC 12 at
// -O2 copied one movss at a time.
inline void copy_strip(const float* src, int n, float* dst) {
  if (n == kRows) {
    std::memcpy(dst, src, kRows * sizeof(float));
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

constexpr int64_t kLineFloats = 16;  // a 64-byte cache line

// Whether dst starts a cache line: a strip of 16 floats then fills it, and its
// non-temporal stores write the whole line (a partial one costs the memory controller a
// read-modify-write).
inline bool line_aligned(const float* dst) { return (reinterpret_cast<uintptr_t>(dst) & 63) == 0; }

// copy_strip into a buffer the call does not read again (the saved pre-activations,
// [T*K, I] each, read by the backward after the whole forward): non-temporal stores
// where dst starts a line, so its lines are not read for ownership first nor kept in the
// caches. The caller fences (_mm_sfence) before another thread reads them.
inline void stream_strip(const float* src, int n, float* dst) {
#if defined(__SSE2__)
  if (n == kRows && line_aligned(dst)) {
    for (int j = 0; j < kRows; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
    return;
  }
#endif
  copy_strip(src, n, dst);
}

// q8 records of rows [0, rows) of src into dst (the tier's quantizer).
void quantize_rows(kernels::Isa isa, const float* src, int64_t stride, int64_t rows, int64_t kp,
                   uint8_t* dst) {
  const kernels::QuantizeRowQ8 quantize = kernels::quantize_row_q8(isa);
  const int64_t rec = formats::q8_record_bytes(kp);
  runtime::ThreadPool::global().run(formats::ceil_div(rows, 16), [&](int64_t task, int) {
    const int64_t end = std::min(rows, (task + 1) * 16);
    for (int64_t r = task * 16; r < end; ++r) quantize(src + r * stride, kp, dst + r * rec);
  });
}

// Bytes of a buffer the call writes and reads back only after a pool barrier (the
// per-slot outputs y, the saved pre-activations) from which it is written past the
// caches (non-temporal stores).
std::atomic<int64_t> g_stream_bytes{int64_t{16} << 20};

// Whether a buffer of that many floats is written past the caches.
bool streamed(int64_t floats) {
  return floats * static_cast<int64_t>(sizeof(float)) >=
         g_stream_bytes.load(std::memory_order_relaxed);
}

// One call of the driver: the layer's sizes, the compute plan of its three
// projections and the forms of the activations that plan reads.
struct Call {
  const MoeLayer& layer;
  const RoutingPlan& routing;
  Scratch& s;
  kernels::Isa isa;
  int64_t T, H, I, K, R;
  int64_t Hp, Ip;  // K extents of gate/up and of down (multiples of 32)
  int64_t ld_hb;   // row stride of s.hb
  kernels::ProjectionPlan gate, up, down;
  kernels::GluRows glu;
  kernels::QuantizeRowQ8 quantize;
  bool x_q8 = false, h_q8 = false;      // some expert's kernel reads q8 records of x / of h
  bool x_bf16 = false, h_bf16 = false;  // some expert's tile kernel reads bf16 rows of x / of h
  // The exact forward (moe_forward_experts_exact): [T*K, I] by slot, its gate / up
  // pre-activations on return; nullptr for inference.
  float* gate_pre = nullptr;
  float* up_pre = nullptr;
  bool stream_pre = false;  // written with non-temporal stores (stream_strip)
  // y written with non-temporal stores (down_block): the combine reads it only after
  // every expert's down blocks, and at that size (134 MB at T = 2048 on a Qwen3-30B-A3B
  // layer) caching its lines would only read them for ownership first.
  bool stream_y = false;
  // The LoRA factors of gate, up, down (nullptr: none) and their first products per plan
  // row (s.lora_t, [R, r]): the block epilogues add s t B^T[:, block].
  const LoraF32* lora[3] = {nullptr, nullptr, nullptr};
  // Gate and up share A (LoraParams::shares_gate_up_a): up's first products are gate's.
  bool up_reuses_gate_t = false;
  // The projection whose first products (s.lora_t) projection p's LoRA term reads.
  int first_products_of(int p) const { return p == 1 && up_reuses_gate_t ? 0 : p; }
  bool pre_only = false;  // the pre-activations alone: no down phase (backward's recompute)
};

// Route: the (token, slot) pairs of the batch, grouped per expert.
const RoutingPlan& route(const MoeLayer& layer, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, Scratch& s) {
  build_routing_plan(layer.op, topk_ids, topk_weights, layer.num_experts, layer.skip_mask(),
                     s.routing);
  return s.routing;
}

// Plan: the compute plan of each projection under this call's modes, and the
// per-call forms of x and h that some active expert's kernel reads.
Call plan_call(const at::Tensor& hidden_states, const MoeLayer& layer, kernels::Isa isa,
               const RoutingPlan& routing, Scratch& s, const kernels::Modes& modes) {
  const bool bf16_act = hidden_states.scalar_type() == at::kBFloat16;
  const int64_t Ip = formats::qint_k_padded(layer.intermediate_size);
  Call c{layer,
         routing,
         s,
         isa,
         hidden_states.size(0),
         layer.hidden_size,
         layer.intermediate_size,
         routing.top_k,
         routing.num_rows(),
         formats::qint_k_padded(layer.hidden_size),
         Ip,
         kernels::tile_rows_ld(Ip),
         {*layer.gate.format, layer.gate.view, isa, modes, bf16_act},
         {*layer.up.format, layer.up.view, isa, modes, bf16_act},
         {*layer.down.format, layer.down.view, isa, modes, bf16_act},
         kernels::glu_rows(isa, layer.glu),
         kernels::quantize_row_q8(isa)};
  c.x_q8 = c.gate.reads_q8() || c.up.reads_q8();
  c.h_q8 = c.down.reads_q8();
  c.stream_y = streamed(c.T * c.K * c.H);
  for (int64_t e : routing.active_experts) {
    const int m = static_cast<int>(routing.expert_offsets[e + 1] - routing.expert_offsets[e]);
    c.x_bf16 = c.x_bf16 || c.gate.reads_bf16(m) || c.up.reads_bf16(m);
    c.h_bf16 = c.h_bf16 || c.down.reads_bf16(m);
  }
  // Every pool thread index of this call's jobs (the pool may be resized between them).
  s.kernels.begin(runtime::ThreadPool::max_threads());
  return c;
}

// Activations: x to fp32 rows, and to q8 records and bf16 rows where the
// plan reads them.
void prepare_activations(const at::Tensor& hidden_states, const Call& c) {
  Scratch& s = c.s;
  const int64_t T = c.T, Hp = c.Hp;
  grow(s.x, T * Hp);
  convert_activations(hidden_states, Hp, s.x.data());
  if (c.x_q8) {
    grow(s.xq, T * formats::q8_record_bytes(Hp));
    quantize_rows(c.isa, s.x.data(), Hp, T, Hp, s.xq.data());
  }
  if (c.x_bf16) {
    // bf16 token rows once; each expert's rows are gathered by the thread
    // that computes it (kernels::ProjectionPlan, from ExpertRows::bf16).
    grow(s.xb, T * Hp);
    runtime::ThreadPool::global().run(formats::ceil_div(T, 16), [&](int64_t task, int) {
      const int64_t end = std::min(T, (task + 1) * 16);
      for (int64_t t = task * 16; t < end; ++t)
        to_bf16_row(s.x.data() + t * Hp, Hp, s.xb.data() + t * Hp);
    });
  }
}

// Rows: the buffers of h (its forms as the plan reads them) and y, and the
// tables of every plan row's x, q8 record, h and h record.
void prepare_rows(const Call& c) {
  Scratch& s = c.s;
  const int64_t Hp = c.Hp, Ip = c.Ip, R = c.R;
  const int64_t x_rec = formats::q8_record_bytes(Hp);
  const int64_t h_rec = formats::q8_record_bytes(Ip);
  grow(s.h, R * Ip);
  grow(s.y, c.T * c.K * c.H + kLineFloats);  // y_rows aligns it to a cache line
  grow(s.x_rows, R);
  grow(s.xq_rows, R);
  grow(s.h_rows, R);
  grow(s.hq_rows, R);
  if (c.h_q8) grow(s.hq, R * h_rec);
  if (c.h_bf16) grow(s.hb, R * c.ld_hb);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = c.routing.row_token[r];
    s.x_rows[r] = s.x.data() + t * Hp;
    s.xq_rows[r] = c.x_q8 ? s.xq.data() + t * x_rec : nullptr;
    s.h_rows[r] = s.h.data() + r * Ip;
    s.hq_rows[r] = c.h_q8 ? s.hq.data() + r * h_rec : nullptr;
    std::fill(s.h.data() + r * Ip + c.I, s.h.data() + (r + 1) * Ip, 0.0f);  // K padding of down
    if (c.h_bf16)
      std::fill(s.hb.data() + r * c.ld_hb + c.I, s.hb.data() + r * c.ld_hb + Ip, uint16_t{0});
  }
}

// Adds bias[0, n_valid) to each of m rows of 16 (a projection's per-expert bias).
void add_bias(float* rows, const float* bias, int m, int n_valid) {
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < n_valid; ++r) rows[i * kRows + r] += bias[r];
}

// The exact forward's pre-activations (LoRA term and bias included): the block's rows
// of 16 into their slots' rows of pre (what backward reads).
void save_pre(const Call& c, const float* rows, float* pre, int64_t nb, int64_t r0, int m,
              int n_valid) {
  for (int i = 0; i < m; ++i) {
    float* dst = pre + c.routing.row_slot[r0 + i] * c.I + nb * kRows;
    if (c.stream_pre)
      stream_strip(rows + i * kRows, n_valid, dst);
    else
      copy_strip(rows + i * kRows, n_valid, dst);
  }
}

// The LoRA term of projection p (0 gate, 1 up, 2 down) for block nb of expert e's m rows:
// d[i][0, n_valid) += s (t_i B^T)[nb * 16 + j], t_i the row's first product (s.lora_t)
// and B^T the block's 16 columns (LoraF32::bt_block), one fma per term (tw_rows). Added
// here, to the block's own rows, not to a whole-row pass over the [T*K, n] outputs first
// (which the epilogue then read back from memory: 4% of the LoRA forward on Zen 4).
void add_lora_block(const Call& c, int p, int64_t e, int64_t nb, int64_t r0, int m, int n_valid,
                    float* d) {
  const LoraF32* f = c.lora[p];
  if (f == nullptr) return;
  const LoraRows bt = f->bt_block(e, nb, n_valid);
  thread_local std::vector<float*> t_rows;
  t_rows.resize(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) t_rows[i] = d + i * kRows;
  lora_products::tw_rows(c.s.lora_t[c.first_products_of(p)].data() + r0 * f->r, m, f->r, bt.p,
                         bt.ld, n_valid, static_cast<float>(c.layer.lora.scaling), true,
                         t_rows.data());
}

// Epilogue of gate/up: h = act(g + bg) * (u + bu) for the block's valid
// columns of expert e's m rows, into h (and its bf16 rows where down reads them).
void glu_epilogue(const Call& c, int64_t e, float* g, float* u, int64_t nb, int64_t r0, int m) {
  const int n_valid = static_cast<int>(std::min<int64_t>(kRows, c.I - nb * kRows));
  if (const float* b = c.layer.gate.bias_row(e)) add_bias(g, b + nb * kRows, m, n_valid);
  if (const float* b = c.layer.up.bias_row(e)) add_bias(u, b + nb * kRows, m, n_valid);
  add_lora_block(c, 0, e, nb, r0, m, n_valid, g);  // nothing without LoRA
  add_lora_block(c, 1, e, nb, r0, m, n_valid, u);
  if (c.gate_pre != nullptr) {
    save_pre(c, g, c.gate_pre, nb, r0, m, n_valid);
    save_pre(c, u, c.up_pre, nb, r0, m, n_valid);
  }
  c.glu(g, u, m, c.layer.glu);
  const bool hb = c.down.reads_bf16(m);
  for (int i = 0; i < m; ++i) {
    const float* gi = g + i * kRows;
    copy_strip(gi, n_valid, c.s.h.data() + (r0 + i) * c.Ip + nb * kRows);
    if (hb) to_bf16_row(gi, n_valid, c.s.hb.data() + (r0 + i) * c.ld_hb + nb * kRows);
  }
}

// Prefetch (for writing) the line at column `col` of each of the m rows' slots of `base`
// (rows n floats apart): the lines the block's epilogue reads or writes after its
// products, one per row of a [T * K, n] buffer far larger than the caches (y: 32 MB at
// T = 512 on a Qwen3-30B-A3B layer), so they arrive while the products run (perf:
// the epilogue's loads of those lines were 4% of the LoRA forward; 1-2% faster on Zen 4).
void prefetch_slot_lines(const Call& c, float* base, int64_t n, int64_t col, int64_t r0, int m) {
  const int64_t* slot = c.routing.row_slot.data() + r0;
  for (int i = 0; i < m; ++i) __builtin_prefetch(base + slot[i] * n + col, 1, 3);
}

// Gate/up: block nb of I of expert e (rows [r0, r0 + m)), then its epilogue.
void gate_up_block(const Call& c, int64_t e, int64_t nb, int64_t r0, int m,
                   kernels::ThreadScratch& ts) {
  Scratch& s = c.s;
  const kernels::ExpertRows rows{0,
                                 e,
                                 m,
                                 s.x_rows.data() + r0,
                                 s.xq_rows.data() + r0,
                                 c.x_bf16 ? s.xb.data() : nullptr,
                                 c.Hp,
                                 c.routing.row_token.data() + r0};
  grow(t_gate_out, static_cast<size_t>(m) * kRows);
  grow(t_up_out, static_cast<size_t>(m) * kRows);
  c.gate.dot_pair(c.up, rows, nb, t_gate_out.data(), t_up_out.data(), ts);
  glu_epilogue(c, e, t_gate_out.data(), t_up_out.data(), nb, r0, m);
}

// Between gate/up and down: an expert's GLU outputs to q8 records, once all
// its gate/up blocks are done (where down reads them).
void quantize_expert(const Call& c, int64_t r0, int m) {
  if (!c.h_q8) return;
  const int64_t rec = formats::q8_record_bytes(c.Ip);
  for (int64_t r = r0; r < r0 + m; ++r)
    c.quantize(c.s.h.data() + r * c.Ip, c.Ip, c.s.hq.data() + r * rec);
}

// Down: block nb of H of expert e (plus its bias), scaled by each row's
// routing weight into the row's slot of y.
void down_block(const Call& c, int64_t e, int64_t nb, int64_t r0, int m,
                kernels::ThreadScratch& ts) {
  Scratch& s = c.s;
  const kernels::ExpertRows rows{1,
                                 e,
                                 m,
                                 s.h_rows.data() + r0,
                                 s.hq_rows.data() + r0,
                                 c.h_bf16 ? s.hb.data() + r0 * c.ld_hb : nullptr,
                                 c.ld_hb,
                                 nullptr};
  grow(t_gate_out, static_cast<size_t>(m) * kRows);
  if (!c.stream_y) prefetch_slot_lines(c, y_rows(s), c.H, nb * kRows, r0, m);
  c.down.dot(rows, nb, t_gate_out.data(), ts);
  const int n_valid = static_cast<int>(std::min<int64_t>(kRows, c.H - nb * kRows));
  add_lora_block(c, 2, e, nb, r0, m, n_valid, t_gate_out.data());  // nothing without LoRA
  if (const float* b = c.layer.down.bias_row(e))
    add_bias(t_gate_out.data(), b + nb * kRows, m, n_valid);
  for (int i = 0; i < m; ++i) {
    float* dst = y_rows(s) + c.routing.row_slot[r0 + i] * c.H + nb * kRows;
    const float w = c.routing.row_weight[r0 + i];
    const float* d = t_gate_out.data() + i * kRows;
#if defined(__SSE2__)
    if (c.stream_y && n_valid == kRows && line_aligned(dst)) {
      const __m128 wv = _mm_set1_ps(w);
      for (int r = 0; r < kRows; r += 4)
        _mm_stream_ps(dst + r, _mm_mul_ps(wv, _mm_loadu_ps(d + r)));
      continue;
    }
#endif
    for (int r = 0; r < n_valid; ++r) dst[r] = w * d[r];
  }
}

// t [m, r] (rows r apart) = in A^T for expert e's m rows of `in` (row i at in[i]): the
// first product of projection p's LoRA term, per plan row into s.lora_t[p].
void lora_first_products(const Call& c, int p, const float* const* in, int64_t e, int64_t r0,
                         int64_t m) {
  const LoraF32& f = *c.lora[p];
  const LoraRows a = f.a_rows(e, m);
  lora_products::xat_rows(in, m, f.k, a.p, a.ld, f.r, c.s.lora_t[p].data() + r0 * f.r);
}

// Before gate/up: x A^T of gate and up for every row, x read where it is.
void lora_input_terms(const Call& c) {
  if (c.lora[0] == nullptr && c.lora[1] == nullptr) return;
  const RoutingPlan& plan = c.routing;
  run_blas_tasks(static_cast<int64_t>(plan.active_experts.size()), [&](int64_t a, int) {
    const int64_t e = plan.active_experts[a], r0 = plan.expert_offsets[e];
    const int64_t m = plan.expert_offsets[e + 1] - r0;
    const float* const* rows = c.s.x_rows.data() + r0;
    for (int p = 0; p < 2; ++p)
      if (c.lora[p] != nullptr && c.first_products_of(p) == p)
        lora_first_products(c, p, rows, e, r0, m);
  });
}

// Between gate/up and down: h Ad^T for every row (an expert's whole h).
void lora_down_terms(const Call& c) {
  if (c.lora[2] == nullptr) return;
  const RoutingPlan& plan = c.routing;
  run_blas_tasks(static_cast<int64_t>(plan.active_experts.size()), [&](int64_t a, int) {
    const int64_t e = plan.active_experts[a], r0 = plan.expert_offsets[e];
    const int64_t m = plan.expert_offsets[e + 1] - r0;
    lora_first_products(c, 2, c.s.h_rows.data() + r0, e, r0, m);
  });
}

// The layer's LoRA factors as fp32 for this call (into `lora`, which outlives the call's
// phases), and room for their first products per plan row; nothing without LoRA.
void attach_lora(Call& call, LoraF32 (&lora)[3]) {
  const LoraParams& params = call.layer.lora;
  if (!params.any()) return;
  const bool shared_a = params.shares_gate_up_a();
  lora[0] = lora_f32(params.gate, 0);
  lora[1] = lora_f32(params.up, 1);
  lora[2] = lora_f32(params.down, 2);
  call.up_reuses_gate_t = shared_a;
  for (int p = 0; p < 3; ++p) {
    if (!lora[p].present()) continue;
    call.lora[p] = &lora[p];
    if (call.first_products_of(p) != p) continue;  // it reads another's
    grow(call.s.lora_t[p], static_cast<size_t>(call.R * lora[p].r));
  }
}

// Experts: gate/up (with its epilogue) and down of every active expert.
void run_experts(const Call& c) {
  kernels::CallScratch& ks = c.s.kernels;
  auto gate_up = [&](int64_t e, int64_t nb, int64_t r0, int m, int thread) {
    gate_up_block(c, e, nb, r0, m, ks.at(thread));
  };
  auto down = [&](int64_t e, int64_t nb, int64_t r0, int m, int thread) {
    down_block(c, e, nb, r0, m, ks.at(thread));
  };
  auto end_run = [&](int thread) {
    kernels::end_run(ks.at(thread));
#if defined(__SSE2__)
    // The non-temporal stores (saved pre-activations, y) visible before the pool's
    // barrier hands them on.
    if (c.stream_pre || c.stream_y) _mm_sfence();
#endif
  };
  // NUMA placement (moe/numa_placement.h): one part unless several nodes.
  const NumaSplit numa = numa_split(c.layer);
  if (c.pre_only) {
    // The backward's recompute of the exact forward's pre-activations: gate/up alone.
    for_each_expert_block(c.routing, numa.gate_up, gate_up, end_run);
    return;
  }
  if (numa.gate_up.parts() == 1 && numa.down.parts() == 1) {
    // One pool job: an expert's down blocks start as soon as its gate/up
    // blocks are done, with no barrier between the phases. The exact (LoRA) forward
    // too: its h rows are still in L2 when h Ad^T and down read them (two phases
    // wrote all of h, 50 MB at T = 2048 on a Qwen3-30B-A3B layer, before reading it
    // back from DRAM). The same bits either way (moe_phases.h).
    // Between an expert's phases: its h as q8 records where down reads them, and
    // (LoRA) h Ad^T from its whole h.
    auto between = [&](int64_t e, int64_t r0, int m) {
      quantize_expert(c, r0, m);
      if (c.lora[2] != nullptr) lora_first_products(c, 2, c.s.h_rows.data() + r0, e, r0, m);
    };
    for_each_expert_block_chained(c.routing, numa.gate_up.blocks, numa.down.blocks, gate_up,
                                  between, down, end_run);
    return;
  }
  // Split across NUMA nodes: each phase's blocks go to their node's threads first.
  for_each_expert_block(c.routing, numa.gate_up, gate_up, end_run);
  if (c.h_q8) quantize_rows(c.isa, c.s.h.data(), c.Ip, c.R, c.Ip, c.s.hq.data());
  lora_down_terms(c);
  for_each_expert_block(c.routing, numa.down, down, end_run);
}

}  // namespace

at::Tensor moe_forward_layer(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const MoeLayer& layer,
                             kernels::Isa isa, const at::Tensor* out) {
  const at::Tensor x = hidden_states.contiguous();
  if (layer.lora.any() && kernels::quant_activations() != kernels::QuantActivations::kQ8) {
    // LoRA: the exact forward (fp32 activations times the exact weights, QLoRA
    // style on a quantized base, without the q8 rounding of the quantized kernels).
    // With quant_activations pinned to 'q8', the inference driver below instead: the
    // base's q8 kernels plus the same LoRA terms (decode with an unmerged adapter on a
    // quantized base near the base's speed; int4 g128, T = 1: 2.8x faster on Zen 4).
    at::Tensor y = moe_forward_lora(x, topk_ids, topk_weights, layer, /*save_pre=*/false).out;
    return out != nullptr ? out->copy_(y) : y;
  }
  at::Tensor result = out != nullptr ? *out : at::empty(x.sizes(), x.options());
  moe_forward_experts(x, topk_ids, topk_weights, layer, isa, result);
  return result;
}

void moe_forward_experts(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, const MoeLayer& layer, kernels::Isa isa,
                         at::Tensor& out) {
  Scratch& s = t_scratch;
  const RoutingPlan& routing = route(layer, topk_ids, topk_weights, s);
  if (hidden_states.size(0) == 0) return;
  Call call = plan_call(hidden_states, layer, isa, routing, s, kernels::Modes::current());
  LoraF32 lora[3];
  attach_lora(call, lora);
  prepare_activations(hidden_states, call);
  prepare_rows(call);
  lora_input_terms(call);
  run_experts(call);
  combine_slots(y_rows(s), routing, out);  // sum the top-k slots in k order, cast
  trim_scratch(s);
}

int64_t set_stream_bytes(int64_t bytes) { return g_stream_bytes.exchange(bytes); }

void moe_forward_experts_exact(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const MoeLayer& layer,
                               kernels::Isa isa, at::Tensor* out, at::Tensor& gate_pre,
                               at::Tensor& up_pre, kernels::ComputePath path) {
  Scratch& s = t_scratch;
  const RoutingPlan& routing = route(layer, topk_ids, topk_weights, s);
  if (hidden_states.size(0) == 0) return;
  // fp32 activations times the exact weights: the streaming kernels, every
  // format decoded to fp32 (no q8 rounding, no bf16 tile kernel).
  const kernels::Modes exact{path, kernels::QuantActivations::kFp32};
  Call call = plan_call(hidden_states, layer, isa, routing, s, exact);
  call.gate_pre = gate_pre.data_ptr<float>();
  call.up_pre = up_pre.data_ptr<float>();
  // The backward reads the saved pre-activations after the whole forward (or, recomputed,
  // after all of gate/up): 100 MB a call at T = 2048 on a Qwen3-30B-A3B layer.
  call.stream_pre = streamed(2 * gate_pre.numel());
  // The rows no expert writes: the slots without one (gate/up's epilogue writes every
  // other row: no zeroing pass over the [T*K, I] buffers, 100 MB at T = 2048).
  for (int64_t q = 0; q < static_cast<int64_t>(routing.slot_valid.size()); ++q) {
    if (routing.slot_valid[q]) continue;
    std::fill_n(call.gate_pre + q * call.I, call.I, 0.0f);
    std::fill_n(call.up_pre + q * call.I, call.I, 0.0f);
  }
  call.pre_only = out == nullptr;
  LoraF32 lora[3];
  attach_lora(call, lora);
  prepare_activations(hidden_states, call);
  prepare_rows(call);
  lora_input_terms(call);
  run_experts(call);
  if (out != nullptr) combine_slots(y_rows(s), routing, *out);
  trim_scratch(s);
}

// Scratch a calling thread keeps between calls (KT_OPS_SCRATCH_KEEP_MB, default
// 512 MiB). Decode and ordinary prefill stay below it (no allocation, no fresh
// page faults per call): the per-slot outputs y alone are T * K * H fp32, 134 MB
// at T = 2048 for a Qwen3-30B-A3B layer, and faulting them in afresh (the
// kernel zeroes every page) cost 18% of that call on Zen 4 (548 -> 446 ms) when
// the limit was 64 MiB. A larger call (e.g. 16k tokens) frees its buffers on
// return instead of holding them for the life of the thread.
size_t scratch_keep_bytes() {
  static const size_t bytes = [] {
    const char* env = std::getenv("KT_OPS_SCRATCH_KEEP_MB");
    if (env == nullptr || env[0] == '\0') return size_t{512} << 20;
    char* end = nullptr;
    const long long mb = std::strtoll(env, &end, 10);
    TORCH_CHECK_VALUE(end != env && *end == '\0' && mb >= 0 && mb <= (1LL << 20),
                      "KT_OPS_SCRATCH_KEEP_MB='", env,
                      "' must be an integer number of MiB in [0, 1048576] (the scratch a calling "
                      "thread keeps between calls; default 512)");
    return static_cast<size_t>(mb) << 20;
  }();
  return bytes;
}

size_t retained_scratch_bytes() { return scratch_bytes(t_scratch); }

}  // namespace kt::moe
