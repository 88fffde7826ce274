#include "moe/moe_forward.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "formats/bf16.h"  // ceil_div
#include "formats/q8_activations.h"
#include "formats/qint.h"
#include "kernels/brgemm.h"
#include "kernels/dispatch.h"
#include "moe/moe_lora.h"
#include "moe/moe_phases.h"
#include "moe/routing.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

namespace {

constexpr int kRows = formats::kQintBlockRows;  // output rows per block, every layout

// Per-calling-thread buffers, grown on demand and reused across calls: a
// decode step allocates nothing, and prefill does not fault in fresh pages.
struct Scratch {
  RoutingPlan plan;
  std::vector<float> x;      // [T][Hp] fp32 activations, zero padded
  std::vector<uint8_t> xq;   // [T] q8 records of x (qint projections)
  std::vector<float> h;      // [rows][Ip] SwiGLU outputs, zero padded
  std::vector<uint8_t> hq;   // [rows] q8 records of h
  std::vector<uint16_t> xt;  // [T][Hp] bf16 activations (brgemm experts' gate/up)
  std::vector<uint16_t>
      hb;                // [rows][bf16_row_stride(Ip)] bf16 SwiGLU outputs (brgemm experts' down)
  std::vector<float> y;  // [T*K][H] weighted expert outputs per slot
  std::vector<const float*> x_rows;
  std::vector<const uint8_t*> xq_rows;
  std::vector<const float*> h_rows;
  std::vector<const uint8_t*> hq_rows;
};

thread_local Scratch t_scratch;

// Scratch a calling thread keeps between calls. Decode and ordinary prefill
// stay below it (no allocation, no fresh page faults per call); a larger call
// (e.g. 16k tokens) frees its buffers on return instead of holding hundreds
// of MB for the life of the thread.
constexpr size_t kScratchKeepBytes = size_t{64} << 20;

template <class T>
size_t capacity_bytes(const std::vector<T>& v) {
  return v.capacity() * sizeof(T);
}

size_t scratch_bytes(const Scratch& s) {
  return capacity_bytes(s.x) + capacity_bytes(s.xq) + capacity_bytes(s.h) + capacity_bytes(s.hq) +
         capacity_bytes(s.xt) + capacity_bytes(s.hb) + capacity_bytes(s.y) +
         capacity_bytes(s.x_rows) + capacity_bytes(s.xq_rows) + capacity_bytes(s.h_rows) +
         capacity_bytes(s.hq_rows);
}

// Releases the calling thread's buffers when they hold more than kScratchKeepBytes.
void trim_scratch(Scratch& s) {
  if (scratch_bytes(s) <= kScratchKeepBytes) return;
  Scratch empty;
  std::swap(s, empty);
}

// Per-task dot products [m][16] and the weight-only path's decoded block;
// grown once per pool thread.
thread_local std::vector<float> t_gate_out, t_up_out, t_block;

std::atomic<QuantActivations> g_quant_activations{QuantActivations::kAuto};
std::atomic<ComputePath> g_compute_path{ComputePath::kAuto};

// Whether the calling thread made brgemm calls since its last release.
thread_local bool t_brgemm_active = false;

// brgemm's A for gate/up: one expert's bf16 activation rows at a fixed stride,
// gathered by the pool thread that computes the expert's blocks and kept
// while it stays on that expert (in L2: 64 rows of H = 2048 are 256 KiB).
// Keyed by (call, expert): a later call never reuses another call's rows.
struct GatheredRows {
  std::vector<uint16_t> rows;
  uint64_t call = 0;
  int64_t expert = -1;
};
thread_local GatheredRows t_gathered;
std::atomic<uint64_t> g_call_counter{0};

// Row stride of the bf16 A operands of the brgemm path (gathered rows, hb):
// kp plus one 64-byte line, so that rows a multiple of 4 KiB apart (H = 2048)
// do not all fall into one L1 set, where the up to 28 rows one tile
// broadcasts from would evict each other at every k step.
int64_t bf16_row_stride(int64_t kp) { return kp + 32; }

// Row i of the result at rows + i * bf16_row_stride(Hp).
const uint16_t* gathered_rows(uint64_t call, int64_t e, const uint16_t* xt, const int64_t* tokens,
                              int m, int64_t Hp) {
  GatheredRows& g = t_gathered;
  if (g.call != call || g.expert != e) {
    const int64_t ld = bf16_row_stride(Hp);
    grow(g.rows, static_cast<size_t>(m) * ld);
    for (int i = 0; i < m; ++i)
      std::memcpy(g.rows.data() + i * ld, xt + tokens[i] * Hp, Hp * sizeof(uint16_t));
    g.call = call;
    g.expert = e;
  }
  return g.rows.data();
}

// Bytes made from one expert's q8 records by the pool thread that computes
// the expert's blocks, kept while it stays on that expert. Keyed by (call,
// phase, expert): phase 0 the gate/up activations, 1 the SwiGLU outputs of
// the down projection; a later call never reuses another call's bytes.
struct ExpertBytesCache {
  std::vector<uint8_t> bytes;
  uint64_t call = 0;
  int phase = -1;
  int64_t expert = -1;

  // The cached bytes of (c, ph, e); on a miss, n bytes made by fill(dst).
  template <class Fill>
  const uint8_t* get(uint64_t c, int ph, int64_t e, size_t n, const Fill& fill) {
    if (call != c || phase != ph || expert != e) {
      grow(bytes, n);
      fill(bytes.data());
      call = c;
      phase = ph;
      expert = e;
    }
    return bytes.data();
  }
};
thread_local ExpertBytesCache t_gathered_u8;  // the u8s8 brgemm's A
thread_local ExpertBytesCache t_u8_tiles;     // the u8 streaming kernel's tiles

// The u8s8 brgemm's A: the expert's q8 codes shifted to u8, with the
// compensation rows (kernels::brgemm::gather_u8s8_rows).
const uint8_t* gathered_u8_rows(uint64_t call, int phase, int64_t e, const uint8_t* const* records,
                                int m, int64_t kp) {
  const size_t n = static_cast<size_t>(kernels::brgemm::u8s8_rows(m)) * kp;
  return t_gathered_u8.get(call, phase, e, n, [&](uint8_t* dst) {
    kernels::brgemm::gather_u8s8_rows(records, m, kp, dst);
  });
}

// The u8 streaming kernel's A (DotArgs::xq_u8): the expert's q8 codes shifted
// to u8 in tiles (kernels::pack_u8_tiles).
const uint8_t* u8_tiles(uint64_t call, int phase, int64_t e, const uint8_t* const* records, int m,
                        int64_t kp) {
  return t_u8_tiles.get(call, phase, e, static_cast<size_t>(m) * kp,
                        [&](uint8_t* dst) { kernels::pack_u8_tiles(records, m, kp, dst); });
}

// After each thread's run of tiles: release the brgemm context (AMX tiles).
void release_brgemm() {
  if (!t_brgemm_active) return;
  kernels::brgemm::release();
  t_brgemm_active = false;
}

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

// How one projection is computed in this call.
struct ProjectionPlan {
  const kernels::ProjectionView* view;
  const kernels::ProjectionKernels* kernels;
  int fp32_min;                // experts with at least this many rows take dot_fp32
  bool q8;                     // some expert may take the q8 kernel: q8 records are needed
  int brgemm_min;              // experts with at least this many rows take brgemm
  kernels::brgemm::Kind kind;  // which brgemm kernel: bf16 rows xb (bf16), fp32 rows x (fp8),
                               // or u8s8 rows xu8
  bool u8_codes;               // the q8 kernel takes 8-bit codes with u8 tiles (DotArgs::xq_u8)

  bool brgemm(int m) const { return m >= brgemm_min; }
  // Whether an expert of m rows runs the q8 kernel on u8 tiles.
  bool wants_u8_codes(int m) const { return u8_codes && !brgemm(m) && m < fp32_min; }
  // Whether an expert of m rows needs the bf16 rows xb / the u8 rows xu8.
  bool wants_xb(int m) const { return kernels::brgemm::takes_bf16_rows(kind) && brgemm(m); }
  bool wants_xu8(int m) const { return kind == kernels::brgemm::Kind::kU8S8 && brgemm(m); }
  int bf16_min() const {
    return kernels::brgemm::takes_bf16_rows(kind) ? brgemm_min : formats::kNoBrgemm;
  }

  void dot(int64_t e, int64_t nb, const float* const* x, const uint8_t* const* xq,
           const uint8_t* xq_u8, const uint16_t* xb, int64_t ldxb, const uint8_t* xu8, int m,
           uint64_t rows_id, float* out) const {
    kernels::DotArgs args{view, e, nb, nb + 1, x, xq, m, out, kRows, nullptr};
    args.rows_id = rows_id;
    if (brgemm(m)) {
      t_brgemm_active = true;
      if (kind == kernels::brgemm::Kind::kU8S8) {
        args.xu8 = xu8;
        kernels::brgemm::u8s8_dot(args);
      } else {
        args.xb = xb;
        args.ldxb = ldxb;
        if (kind == kernels::brgemm::Kind::kFp8Bf16)
          kernels::brgemm::fp8_dot(args);
        else
          kernels::brgemm::bf16_dot(args);
      }
    } else if (m >= fp32_min) {
      grow(t_block, static_cast<size_t>(kRows) * view->kp);  // the block decoded to fp32
      args.scratch = t_block.data();
      kernels->dot_fp32(args);
    } else {
      if (u8_codes) args.xq_u8 = xq_u8;
      kernels->dot(args);
    }
  }
};

// brgemm_min: brgemm_min_tokens() of the projection's format, or kNoBrgemm
// for this call. Under 'auto' the bf16-row kernels (bf16, fp8) take bf16
// activations only (they round fp32/fp16 ones to bf16) and the u8s8 kernel
// any activations (the same q8 records and results as the streaming q8
// kernels).
ProjectionPlan plan_projection(const Projection& p, kernels::Isa isa, QuantActivations mode,
                               ComputePath path, bool bf16_activations) {
  const kernels::ProjectionKernels& k = kernels::projection_kernels(p.format->layout, isa);
  int fp32_min = formats::kNoFp32Path;  // fp32_min_tokens: kNoFp32Path without dot_fp32
  if (mode == QuantActivations::kFp32 && k.dot_fp32 != nullptr) fp32_min = 1;
  if (mode == QuantActivations::kAuto) fp32_min = fp32_min_tokens(*p.format, isa);
  const bool q8 = p.format->activation == formats::ActType::kQ8 && fp32_min > 1;
  const kernels::brgemm::Kind kind = kernels::brgemm::kind(*p.format);
  const bool brgemm_allowed =
      path == ComputePath::kBrgemm ||
      (path == ComputePath::kAuto && (bf16_activations || kind == kernels::brgemm::Kind::kU8S8));
  const int brgemm_min = brgemm_allowed ? brgemm_min_tokens(*p.format, isa) : formats::kNoBrgemm;
  const bool u8_codes = q8 && k.u8_codes && p.format->layout == formats::Layout::kQint &&
                        p.format->qint.bits == 8 && p.format->qint.is_signed;
  return {&p.view, &k, fp32_min, q8, brgemm_min, kind, u8_codes};
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

}  // namespace

void set_quant_activations(QuantActivations mode) { g_quant_activations.store(mode); }
QuantActivations quant_activations() { return g_quant_activations.load(); }
void set_compute_path(ComputePath path) { g_compute_path.store(path); }
ComputePath compute_path() { return g_compute_path.load(); }

int fp32_min_tokens(const formats::FormatRow& format, kernels::Isa isa) {
  const kernels::ProjectionKernels& k = kernels::projection_kernels(format.layout, isa);
  if (k.dot_fp32 == nullptr) return formats::kNoFp32Path;
  return format.fp32_min_tokens.min(k.u8_codes ? formats::Fp32Class::kVnni
                                               : formats::Fp32Class::kBase);
}

int brgemm_min_tokens(const formats::FormatRow& format, kernels::Isa isa) {
  const ComputePath path = compute_path();
  if (path == ComputePath::kStreaming) return formats::kNoBrgemm;
  // The u8s8 kernel multiplies q8 activations: not when they are off.
  if (kernels::brgemm::kind(format) == kernels::brgemm::Kind::kU8S8 &&
      quant_activations() == QuantActivations::kFp32)
    return formats::kNoBrgemm;
  const std::optional<formats::BrgemmIsa> cls = kernels::brgemm::runs(format, isa);
  if (!cls) return formats::kNoBrgemm;
  return path == ComputePath::kBrgemm ? 1 : format.brgemm.min(*cls);
}

at::Tensor moe_forward_layer(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const MoeLayer& layer,
                             kernels::Isa isa, const at::Tensor* out) {
  const at::Tensor x = hidden_states.contiguous();
  if (layer.lora.any()) {
    // LoRA: the ATen expert path. Any format: the base is dequantized to fp32 per
    // expert (QLoRA style) and multiplies fp32 activations, without the q8
    // rounding of the quantized kernels.
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
  const int64_t T = hidden_states.size(0);
  const int64_t H = layer.hidden_size;
  const int64_t I = layer.intermediate_size;
  const int64_t K = topk_ids.size(1);
  Scratch& s = t_scratch;
  build_routing_plan(layer.op, topk_ids, topk_weights, layer.num_experts, layer.skip_mask(),
                     s.plan);
  if (T == 0) return;
  const RoutingPlan& plan = s.plan;
  const int64_t R = plan.num_rows();

  const QuantActivations mode = quant_activations();
  // 'auto' takes the bf16 brgemm kernels (bf16 weights, and fp8 decoded to
  // bf16 tiles) only for bf16 activations: bf16 multiplies them exactly (the
  // SwiGLU outputs are rounded to bf16, as in torch's bf16 expert MLP), fp8
  // rounds them once with its scales; fp32 and fp16 activations keep their
  // precision on the streaming kernels unless 'brgemm' is forced.
  const ComputePath path = compute_path();
  const bool bf16_act = hidden_states.scalar_type() == at::kBFloat16;
  const ProjectionPlan gate = plan_projection(layer.gate, isa, mode, path, bf16_act);
  const ProjectionPlan up = plan_projection(layer.up, isa, mode, path, bf16_act);
  const ProjectionPlan down = plan_projection(layer.down, isa, mode, path, bf16_act);
  const kernels::GluRows glu = kernels::glu_rows(isa, layer.activation);
  const int64_t Hp = formats::qint_k_padded(H);
  const int64_t Ip = formats::qint_k_padded(I);
  const bool x_q8 = gate.q8 || up.q8;

  // Phase 1: activations to fp32, then to q8 records for the integer formats.
  grow(s.x, T * Hp);
  convert_activations(hidden_states, Hp, s.x.data());
  const int64_t x_rec = formats::q8_record_bytes(Hp);
  const int64_t h_rec = formats::q8_record_bytes(Ip);
  // Which per-call rows some expert needs: the bf16 rows (xt / hb) of the
  // brgemm experts. (The u8 tiles of the q8 kernels on 8-bit signed codes,
  // ProjectionPlan::wants_u8_codes, are packed per expert by its threads.)
  const int gu_bf16_min = std::min(gate.bf16_min(), up.bf16_min());
  bool gu_brgemm = false, down_brgemm = false;
  for (int64_t e : plan.active_experts) {
    const int m = static_cast<int>(plan.expert_offsets[e + 1] - plan.expert_offsets[e]);
    gu_brgemm = gu_brgemm || m >= gu_bf16_min;
    down_brgemm = down_brgemm || down.wants_xb(m);
  }
  if (x_q8) {
    grow(s.xq, T * x_rec);
    quantize_rows(isa, s.x.data(), Hp, T, Hp, s.xq.data());
  }
  grow(s.h, R * Ip);
  grow(s.y, T * K * H);
  grow(s.x_rows, R);
  grow(s.xq_rows, R);
  grow(s.h_rows, R);
  grow(s.hq_rows, R);
  if (down.q8) grow(s.hq, R * h_rec);
  const uint64_t call = ++g_call_counter;
  if (gu_brgemm) {
    // bf16 token rows once; each brgemm expert's rows are gathered by the
    // thread that computes it (gathered_rows).
    grow(s.xt, T * Hp);
    runtime::ThreadPool::global().run(formats::ceil_div(T, 16), [&](int64_t task, int) {
      const int64_t end = std::min(T, (task + 1) * 16);
      for (int64_t t = task * 16; t < end; ++t)
        to_bf16_row(s.x.data() + t * Hp, Hp, s.xt.data() + t * Hp);
    });
  }
  const int64_t ld_xb = bf16_row_stride(Hp);  // row strides of the brgemm experts' bf16 A
  const int64_t ld_hb = bf16_row_stride(Ip);
  if (down_brgemm) grow(s.hb, R * ld_hb);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = plan.row_token[r];
    s.x_rows[r] = s.x.data() + t * Hp;
    s.xq_rows[r] = x_q8 ? s.xq.data() + t * x_rec : nullptr;
    s.h_rows[r] = s.h.data() + r * Ip;
    s.hq_rows[r] = down.q8 ? s.hq.data() + r * h_rec : nullptr;
    std::fill(s.h.data() + r * Ip + I, s.h.data() + (r + 1) * Ip, 0.0f);  // K padding of down
    if (down_brgemm)
      std::fill(s.hb.data() + r * ld_hb + I, s.hb.data() + r * ld_hb + Ip, uint16_t{0});
  }

  // NUMA placement (moe/numa_placement.h): one part unless several nodes.
  const NumaSplit numa = numa_split(layer);

  // Phase 2: gate/up + the GLU activation, one item per (active expert, 16-row block of I).
  auto gate_up_block = [&](int64_t e, int64_t nb, int64_t r0, int m) {
    const int n_valid = static_cast<int>(std::min<int64_t>(kRows, I - nb * kRows));
    grow(t_gate_out, static_cast<size_t>(m) * kRows);
    grow(t_up_out, static_cast<size_t>(m) * kRows);
    const uint16_t* xb =
        m >= gu_bf16_min ? gathered_rows(call, e, s.xt.data(), plan.row_token.data() + r0, m, Hp)
                         : nullptr;
    const uint8_t* xu8 = gate.wants_xu8(m) || up.wants_xu8(m)
                             ? gathered_u8_rows(call, 0, e, s.xq_rows.data() + r0, m, Hp)
                             : nullptr;
    const uint8_t* const* xq = s.xq_rows.data() + r0;
    const uint8_t* xu =
        gate.wants_u8_codes(m) || up.wants_u8_codes(m) ? u8_tiles(call, 0, e, xq, m, Hp) : nullptr;
    gate.dot(e, nb, s.x_rows.data() + r0, xq, xu, xb, ld_xb, xu8, m, 2 * call, t_gate_out.data());
    up.dot(e, nb, s.x_rows.data() + r0, xq, xu, xb, ld_xb, xu8, m, 2 * call, t_up_out.data());
    glu(t_gate_out.data(), t_up_out.data(), m);
    const bool hb = down.wants_xb(m);
    for (int i = 0; i < m; ++i) {
      const float* g = t_gate_out.data() + i * kRows;
      std::copy(g, g + n_valid, s.h.data() + (r0 + i) * Ip + nb * kRows);
      if (hb) to_bf16_row(g, n_valid, s.hb.data() + (r0 + i) * ld_hb + nb * kRows);
    }
  };

  // Phase 2b: an expert's SwiGLU outputs to q8 records, once all its gate/up blocks are done.
  const kernels::QuantizeRowQ8 quantize = kernels::quantize_row_q8(isa);
  auto quantize_expert_rows = [&](int64_t, int64_t r0, int m) {
    if (!down.q8) return;
    for (int64_t r = r0; r < r0 + m; ++r)
      quantize(s.h.data() + r * Ip, Ip, s.hq.data() + r * h_rec);
  };

  // Phase 3: down projection scaled by the routing weight, per (expert, 16-row block of H).
  float* y = s.y.data();
  auto down_block = [&](int64_t e, int64_t nb, int64_t r0, int m) {
    const int n_valid = static_cast<int>(std::min<int64_t>(kRows, H - nb * kRows));
    grow(t_gate_out, static_cast<size_t>(m) * kRows);
    const uint16_t* hb = down_brgemm ? s.hb.data() + r0 * ld_hb : nullptr;  // brgemm experts' A
    const uint8_t* hu8 =
        down.wants_xu8(m) ? gathered_u8_rows(call, 1, e, s.hq_rows.data() + r0, m, Ip) : nullptr;
    const uint8_t* hu =
        down.wants_u8_codes(m) ? u8_tiles(call, 1, e, s.hq_rows.data() + r0, m, Ip) : nullptr;
    down.dot(e, nb, s.h_rows.data() + r0, s.hq_rows.data() + r0, hu, hb, ld_hb, hu8, m,
             2 * call + 1, t_gate_out.data());
    for (int i = 0; i < m; ++i) {
      float* dst = y + plan.row_slot[r0 + i] * H + nb * kRows;
      const float w = plan.row_weight[r0 + i];
      const float* d = t_gate_out.data() + i * kRows;
      for (int r = 0; r < n_valid; ++r) dst[r] = w * d[r];
    }
  };

  if (numa.gate_up.parts() == 1 && numa.down.parts() == 1) {
    // One pool job: an expert's down blocks start as soon as its gate/up
    // blocks are done, with no barrier between the phases.
    for_each_expert_block_chained(plan, numa.gate_up.blocks, numa.down.blocks, gate_up_block,
                                  quantize_expert_rows, down_block, release_brgemm);
  } else {
    // Split across NUMA nodes: each phase's blocks go to their node's threads first.
    for_each_expert_block(plan, numa.gate_up, gate_up_block, release_brgemm);
    if (down.q8) quantize_rows(isa, s.h.data(), Ip, R, Ip, s.hq.data());
    for_each_expert_block(plan, numa.down, down_block, release_brgemm);
  }

  // Phase 4: sum the top-k slots of each token in k order, cast to the output dtype.
  combine_slots(y, plan, out);
  trim_scratch(s);
}

size_t retained_scratch_bytes() { return scratch_bytes(t_scratch); }

}  // namespace kt::moe
