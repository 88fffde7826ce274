#include "moe/moe_lora.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "formats/bf16.h"
#include "kernels/activations.h"
#include "moe/routing.h"
#include "runtime/thread_pool.h"

// Intel MKL's per-thread thread count (the C entry point behind mkl_service.h's
// mkl_set_num_threads_local macro; the lower-case symbol is the Fortran one,
// which takes a pointer), exported by the MKL builds of libtorch (the x86-64
// torch wheels). Weak, so a build against another BLAS still loads;
// run_expert_tasks then runs the experts one after another.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace kt::moe {

namespace {

const at::TensorOptions kF32 = at::TensorOptions().dtype(at::kFloat);

// Non-owning fp32 view of memory this file owns or a validated tensor holds.
// from_blob tensors carry no autograd history, whatever the source tensor had.
at::Tensor view(const float* p, at::IntArrayRef sizes) {
  return at::from_blob(const_cast<float*>(p), sizes, kF32);
}

// Holds the BLAS to one thread on the calling thread. Pool tasks run GEMMs
// side by side: a multi-threaded GEMM would start an OpenMP team on every
// pool thread (oversubscription), and MKL's sgemm rounds differently for
// different thread counts (measured: m = 7 rows), which would make results
// depend on the thread count.
class SequentialBlasGuard {
 public:
  SequentialBlasGuard() : prev_(MKL_Set_Num_Threads_Local(1)) {}
  ~SequentialBlasGuard() { MKL_Set_Num_Threads_Local(prev_); }  // 0 = back to the global count
  SequentialBlasGuard(const SequentialBlasGuard&) = delete;
  SequentialBlasGuard& operator=(const SequentialBlasGuard&) = delete;

 private:
  int prev_;
};

// fn(task, thread_index) for task in [0, n). On the pool when the BLAS can be
// held to one thread per pool thread; otherwise on the calling thread alone
// (each GEMM then uses the BLAS's own threads). Tasks call only at::mm-family
// ops and plain loops: ATen's elementwise ops would start OpenMP teams from
// pool threads.
template <class F>
void run_expert_tasks(int64_t n, const F& fn) {
  if (MKL_Set_Num_Threads_Local == nullptr) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }
  runtime::ThreadPool::global().run(n, [&](int64_t task, int thread) {
    SequentialBlasGuard blas;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // temporaries need no autograd
    fn(task, thread);
  });
}

int num_task_threads() {
  return MKL_Set_Num_Threads_Local ? runtime::ThreadPool::global().num_threads() : 1;
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

// fp32 copies of one projection's LoRA factors for every expert.
struct LoraF32 {
  at::Tensor a_t, b_t;  // keep the storage alive
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t r = 0, n = 0, k = 0;
  bool present() const { return a != nullptr; }
  at::Tensor A(int64_t e) const { return view(a + e * r * k, {r, k}); }  // [r, k]
  at::Tensor B(int64_t e) const { return view(b + e * n * r, {n, r}); }  // [n, r]
};

LoraF32 lora_f32(const LoraProjection& p) {
  LoraF32 f;
  if (!p.present()) return f;
  f.a_t = p.a.to(at::kFloat).contiguous();
  f.b_t = p.b.to(at::kFloat).contiguous();
  f.a = f.a_t.data_ptr<float>();
  f.b = f.b_t.data_ptr<float>();
  f.r = p.a.size(1);
  f.k = p.a.size(2);
  f.n = p.b.size(1);
  return f;
}

// out = in @ W^T + s * (in @ A^T) @ B^T for one projection of expert e.
// `in` [m, k], w [n, k] (any strides); returns in @ A^T ([m, r], needed by backward) or an
// undefined tensor without LoRA.
at::Tensor project(const at::Tensor& in, const at::Tensor& w, const LoraF32& lora, int64_t e,
                   float s, at::Tensor out) {
  at::mm_out(out, in, w.t());
  if (!lora.present()) return at::Tensor();
  at::Tensor in_a = at::mm(in, lora.A(e).t());
  out.addmm_(in_a, lora.B(e).t(), 1.0, s);
  return in_a;
}

// rows i of src ([rows, n], row-major) -> dst[index[i] * n ...]
void scatter_rows(const float* src, int64_t rows, int64_t n, const int64_t* index, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(dst + index[i] * n, src + i * n, n * sizeof(float));
}

// dst row i <- src[index[i] * n ...]
void gather_rows(const float* src, int64_t rows, int64_t n, const int64_t* index, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(dst + i * n, src + index[i] * n, n * sizeof(float));
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

// Scratch for the dense fp32 weights of the expert a task works on, one set
// per pool thread and call (allocated on first use: page faults once per
// call, not per expert).
struct ThreadWeights {
  at::Tensor gate, up, down;
};

// rows[i, :] += bias for m rows of n fp32 values (a projection's per-expert
// bias, or nothing when it has none).
void add_bias(const at::Tensor& rows, const float* bias) {
  if (bias == nullptr) return;
  float* p = rows.data_ptr<float>();
  const int64_t m = rows.size(0), n = rows.size(1);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) p[i * n + j] += bias[j];
}

const at::Tensor& ensure(at::Tensor& t, int64_t numel) {
  if (!t.defined()) t = at::empty({numel}, kF32);
  return t;
}

}  // namespace

LoraForwardResult moe_forward_lora(const at::Tensor& x, const at::Tensor& topk_ids,
                                   const at::Tensor& topk_weights, const MoeLayer& w,
                                   bool save_pre) {
  const LoraParams& lora = w.lora;
  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1);
  const int64_t E = w.gate.num_experts(), I = w.gate.n;
  LoraForwardResult res;
  res.out = at::empty({T, H}, x.options());
  if (save_pre) {
    res.gate_pre = at::zeros({T * K, I}, kF32);
    res.up_pre = at::zeros({T * K, I}, kF32);
  }
  if (T == 0 || H == 0) return res;

  RoutingPlan plan;
  build_routing_plan(w.op, topk_ids, topk_weights, E, w.skip_mask(), plan);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const LoraF32 lg = lora_f32(lora.gate), lu = lora_f32(lora.up), ld = lora_f32(lora.down);
  const float s = static_cast<float>(lora.scaling);
  // y[t*K + k] = w[t, k] * expert(x[t]); each slot written by exactly one task.
  const at::Tensor slots = at::empty({T * K, H}, kF32);
  float* yp = slots.data_ptr<float>();
  float* gpre = save_pre ? res.gate_pre.data_ptr<float>() : nullptr;
  float* upre = save_pre ? res.up_pre.data_ptr<float>() : nullptr;

  const std::vector<int64_t> order = experts_by_load(plan);
  std::vector<ThreadWeights> weights(num_task_threads());
  const int64_t scratch_numel =
      std::max({dense_expert_weight_numel(w.gate), dense_expert_weight_numel(w.up),
                dense_expert_weight_numel(w.down)});
  run_expert_tasks(static_cast<int64_t>(order.size()), [&](int64_t task, int thread) {
    const int64_t e = order[task];
    const int64_t r0 = plan.expert_offsets[e];
    const int64_t m = plan.expert_offsets[e + 1] - r0;
    const int64_t* slot = plan.row_slot.data() + r0;
    ThreadWeights& tw = weights[thread];
    // One scratch buffer serves the three projections in turn.
    const at::Tensor& scratch = ensure(tw.gate, scratch_numel);

    at::Tensor xe = at::empty({m, H}, kF32);
    gather_rows(xp, m, H, plan.row_token.data() + r0, xe.data_ptr<float>());
    at::Tensor g = at::empty({m, I}, kF32), u = at::empty({m, I}, kF32);
    project(xe, dense_expert_weight(w.gate, e, scratch), lg, e, s, g);
    project(xe, dense_expert_weight(w.up, e, scratch), lu, e, s, u);
    add_bias(g, w.gate.bias_row(e));
    add_bias(u, w.up.bias_row(e));
    float* gp = g.data_ptr<float>();
    const float* up = u.data_ptr<float>();
    if (save_pre) {
      scatter_rows(gp, m, I, slot, gpre);
      scatter_rows(up, m, I, slot, upre);
    }
    for (int64_t i = 0; i < m * I; ++i) gp[i] = kernels::glu_value(w.glu, gp[i], up[i]);

    at::Tensor y = at::empty({m, H}, kF32);
    project(g, dense_expert_weight(w.down, e, scratch), ld, e, s, y);
    add_bias(y, w.down.bias_row(e));
    const float* yr = y.data_ptr<float>();
    const float* rw = plan.row_weight.data() + r0;
    for (int64_t i = 0; i < m; ++i) {
      float* dst = yp + slot[i] * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = rw[i] * yr[i * H + j];
    }
  });
  combine_slots(yp, plan, H, res.out);
  return res;
}

namespace {

// A saved pre-activation: fp32 [T*K, I], contiguous, on the CPU.
void check_pre(const at::Tensor& t, const char* name, int64_t rows, int64_t I) {
  TORCH_CHECK(t.device().is_cpu(), "kt.moe_backward: ", name, " is on ", t.device(),
              "; it must be the CPU tensor that kt.moe_forward_train returned");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == I && t.is_contiguous(),
              "kt.moe_backward: ", name, " must be a contiguous fp32 [T*K=", rows, ", I=", I,
              "] tensor as returned by kt.moe_forward_train, got ", t.scalar_type(), " ",
              t.sizes());
}

}  // namespace

void check_backward_args(const MoeLayer& layer, const at::Tensor& grad_output,
                         const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const std::optional<at::Tensor>& gate_pre,
                         const std::optional<at::Tensor>& up_pre) {
  TORCH_CHECK(grad_output.device().is_cpu(), "kt.moe_backward: grad_output is on ",
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
    check_pre(*gate_pre, "gate_pre", rows, layer.intermediate_size);
    check_pre(*up_pre, "up_pre", rows, layer.intermediate_size);
  }
}

MoeGrads moe_backward_lora(const at::Tensor& grad_output, const at::Tensor& x,
                           const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const MoeLayer& w, const at::Tensor& gate_pre, const at::Tensor& up_pre,
                           bool compute_grad_x) {
  const LoraParams& lora = w.lora;
  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1);
  const int64_t E = w.gate.num_experts(), I = w.gate.n;
  const LoraF32 lg = lora_f32(lora.gate), lu = lora_f32(lora.up), ld = lora_f32(lora.down);
  const float s = static_cast<float>(lora.scaling);
  const bool saved = gate_pre.defined();

  // fp32 accumulators; experts without tokens keep zero LoRA gradients.
  at::Tensor grad_w = at::zeros({T, K}, kF32);
  auto lora_grads = [&](const LoraF32& l) {
    return l.present()
               ? std::make_pair(at::zeros({E, l.r, l.k}, kF32), at::zeros({E, l.n, l.r}, kF32))
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
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const at::Tensor gof = grad_output.to(at::kFloat).contiguous();
    const float* xp = xf.data_ptr<float>();
    const float* gop = gof.data_ptr<float>();
    const float* gpre = saved ? gate_pre.data_ptr<float>() : nullptr;
    const float* upre = saved ? up_pre.data_ptr<float>() : nullptr;
    at::Tensor dx_slots;
    if (compute_grad_x) dx_slots = at::empty({T * K, H}, kF32);
    float* dxp = compute_grad_x ? dx_slots.data_ptr<float>() : nullptr;
    float* gwp = grad_w.data_ptr<float>();

    const std::vector<int64_t> order = experts_by_load(plan);
    std::vector<ThreadWeights> weights(num_task_threads());
    run_expert_tasks(static_cast<int64_t>(order.size()), [&](int64_t task, int thread) {
      const int64_t e = order[task];
      const int64_t r0 = plan.expert_offsets[e];
      const int64_t m = plan.expert_offsets[e + 1] - r0;
      const int64_t* slot = plan.row_slot.data() + r0;
      const int64_t* token = plan.row_token.data() + r0;
      const float* rw = plan.row_weight.data() + r0;
      ThreadWeights& tw = weights[thread];
      // Wg and Wu serve the pre-activations and grad x; only dequantized when used.
      const bool need_gate_up_w = compute_grad_x || !saved;
      at::Tensor wg, wu;  // [I, H]
      if (need_gate_up_w) {
        wg = dense_expert_weight(w.gate, e, ensure(tw.gate, dense_expert_weight_numel(w.gate)));
        wu = dense_expert_weight(w.up, e, ensure(tw.up, dense_expert_weight_numel(w.up)));
      }

      at::Tensor xe = at::empty({m, H}, kF32);
      gather_rows(xp, m, H, token, xe.data_ptr<float>());
      at::Tensor g = at::empty({m, I}, kF32), u = at::empty({m, I}, kF32);
      at::Tensor xa_g, xa_u;  // x A^T of gate / up, for the B gradients
      if (saved) {
        gather_rows(gpre, m, I, slot, g.data_ptr<float>());
        gather_rows(upre, m, I, slot, u.data_ptr<float>());
        if (lg.present()) xa_g = at::mm(xe, lg.A(e).t());
        if (lu.present()) xa_u = at::mm(xe, lu.A(e).t());
      } else {
        xa_g = project(xe, wg, lg, e, s, g);
        xa_u = project(xe, wu, lu, e, s, u);
        add_bias(g, w.gate.bias_row(e));
        add_bias(u, w.up.bias_row(e));
      }
      float* gp = g.data_ptr<float>();
      float* up = u.data_ptr<float>();
      at::Tensor h = at::empty({m, I}, kF32);
      float* hp = h.data_ptr<float>();
      for (int64_t i = 0; i < m * I; ++i) hp[i] = kernels::glu_value(w.glu, gp[i], up[i]);

      // dh_u = dL/dh before the routing weight: go Wd + s (go Bd) Ad.
      at::Tensor go = at::empty({m, H}, kF32);
      gather_rows(gop, m, H, token, go.data_ptr<float>());
      const at::Tensor wd =
          dense_expert_weight(w.down, e, ensure(tw.down, dense_expert_weight_numel(w.down)));
      at::Tensor dh = at::mm(go, wd);  // [m, I]
      at::Tensor go_b;                 // go Bd [m, rd]
      if (ld.present()) {
        go_b = at::mm(go, ld.B(e));
        dh.addmm_(go_b, ld.A(e), 1.0, s);
      }
      // d out[t] / d w[t, k] = <go, y> = <dh_u, h> (+ <go, bd> with a down bias).
      float* dhp = dh.data_ptr<float>();
      const float* bd = w.down.bias_row(e);
      const float* gorow = go.data_ptr<float>();
      for (int64_t i = 0; i < m; ++i) {
        float dot = 0.0f;
        for (int64_t j = 0; j < I; ++j) dot += dhp[i * I + j] * hp[i * I + j];
        if (bd != nullptr)
          for (int64_t j = 0; j < H; ++j) dot += gorow[i * H + j] * bd[j];
        gwp[slot[i]] = dot;
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < I; ++j) dhp[i * I + j] *= rw[i];
      }
      if (ld.present()) {
        // dBd = s go^T (w * (h Ad^T)), dAd = s (w * go Bd)^T h.
        at::Tensor ha = at::mm(h, ld.A(e).t());
        float* hap = ha.data_ptr<float>();
        float* gbp = go_b.data_ptr<float>();
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < ld.r; ++j) {
            hap[i * ld.r + j] *= rw[i];
            gbp[i * ld.r + j] *= rw[i];
          }
        }
        view(gb_d.data_ptr<float>() + e * H * ld.r, {H, ld.r}).addmm_(go.t(), ha, 0.0, s);
        view(ga_d.data_ptr<float>() + e * ld.r * I, {ld.r, I}).addmm_(go_b.t(), h, 0.0, s);
      }

      // dg = dh * u * act'(g), du = dh * act(g); written over g and u.
      for (int64_t i = 0; i < m * I; ++i)
        kernels::glu_backward(w.glu, gp[i], up[i], dhp[i], &gp[i], &up[i]);
      const at::Tensor& dg = g;
      const at::Tensor& du = u;
      // dB = s d^T (x A^T), dA = s (d B)^T x for the gate and up LoRA.
      auto input_lora_grads = [&](const LoraF32& l, const at::Tensor& d, const at::Tensor& xa,
                                  const at::Tensor& grad_a, const at::Tensor& grad_b) {
        if (!l.present()) return at::Tensor();
        at::Tensor d_b = at::mm(d, l.B(e));  // [m, r]
        view(grad_b.data_ptr<float>() + e * I * l.r, {I, l.r}).addmm_(d.t(), xa, 0.0, s);
        view(grad_a.data_ptr<float>() + e * l.r * H, {l.r, H}).addmm_(d_b.t(), xe, 0.0, s);
        return d_b;
      };
      const at::Tensor dg_b = input_lora_grads(lg, dg, xa_g, ga_g, gb_g);
      const at::Tensor du_b = input_lora_grads(lu, du, xa_u, ga_u, gb_u);
      if (compute_grad_x) {
        // dx = dg Wg + du Wu + s (dg Bg) Ag + s (du Bu) Au.
        at::Tensor dx = at::mm(dg, wg);
        dx.addmm_(du, wu);
        if (lg.present()) dx.addmm_(dg_b, lg.A(e), 1.0, s);
        if (lu.present()) dx.addmm_(du_b, lu.A(e), 1.0, s);
        scatter_rows(dx.data_ptr<float>(), m, H, slot, dxp);
      }
    });
    if (compute_grad_x) combine_slots(dxp, plan, H, grad_x);
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
