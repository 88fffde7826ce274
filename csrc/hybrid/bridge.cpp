#include "hybrid/bridge.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <array>
#include <atomic>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>

#include "kernels/dispatch.h"
#include "moe/moe_forward.h"
#include "moe/moe_lora.h"
#include "runtime/thread_pool.h"

namespace kt::hybrid {

namespace {

std::mutex g_error_mu;
std::string g_error;                     // the first failure not yet raised
std::atomic<bool> g_caller_waits{true};  // set_caller_waits (an A/B switch for benchmarks)

void record_error(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_error_mu);
  if (g_error.empty()) g_error = msg;
}

void raise_deferred(const char* op, const Transport& t) {
  const std::string msg = take_deferred_error();
  TORCH_CHECK(msg.empty(), op, ": an earlier kt_ops call on ", t.device_name(),
              " failed in its CPU part (its outputs were filled with NaN): ", msg);
}

void check_on(const char* op, const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
              " but hidden_states is on ", device,
              "; with device hidden states, every tensor but the packed expert weights (which "
              "stay in host memory) must be on that device");
}

// The inputs and outputs of one call in host staging memory: each device
// tensor has a host twin of the same dtype and shape at a 64-byte aligned
// offset of one block.
class Staging {
 public:
  int input(const at::Tensor& device) { return add(device.contiguous(), true); }
  int output(const at::Tensor& device) { return add(device, false); }
  size_t bytes() const { return bytes_; }

  void bind(void* base) {
    base_ = static_cast<char*>(base);
    for (Entry& e : entries_)
      e.host = at::from_blob(base_ + e.offset, e.device.sizes(),
                             at::TensorOptions().dtype(e.device.scalar_type()));
  }
  const at::Tensor& host(int i) const { return entries_[i].host; }
  const at::Tensor& device(int i) const { return entries_[i].device; }

  void copy_in(Transport& t) const {
    for (const Entry& e : entries_)
      if (e.is_input && e.bytes > 0) t.copy_to_host(base_ + e.offset, e.device);
  }
  void copy_out(Transport& t) const {
    for (const Entry& e : entries_)
      if (!e.is_input && e.bytes > 0) t.copy_to_device(e.device, base_ + e.offset);
  }

 private:
  struct Entry {
    at::Tensor device;
    at::Tensor host;
    size_t offset = 0;
    size_t bytes = 0;
    bool is_input = false;
  };
  int add(const at::Tensor& device, bool is_input) {
    Entry e;
    e.device = device;
    e.bytes = static_cast<size_t>(device.numel()) * device.element_size();
    e.offset = (bytes_ + 63) / 64 * 64;
    e.is_input = is_input;
    bytes_ = e.offset + e.bytes;
    entries_.push_back(std::move(e));
    return static_cast<int>(entries_.size()) - 1;
  }
  std::vector<Entry> entries_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
};

enum class Kind { kForward, kForwardTrain, kBackward };

// Everything the host function reads: the parsed layer (over the staged
// views; it holds the packed weights alive) and the staged tensors.
struct BridgeCall {
  Kind kind = Kind::kForward;
  kernels::Isa isa{};
  moe::MoeLayer layer;
  at::Tensor x, ids, w, grad_output, gate_pre, up_pre;  // staged inputs (pre: may be undefined)
  bool compute_grad_x = true;
  // Staged outputs; undefined where the op has none.
  at::Tensor out, out_gate_pre, out_up_pre, grad_x, grad_w;
  std::array<at::Tensor, 6> grad_lora;
  bool delete_after_run = true;  // eager; a captured call is kept by the pool

  std::vector<at::Tensor> outputs() const {
    std::vector<at::Tensor> v = {out, out_gate_pre, out_up_pre, grad_x, grad_w};
    v.insert(v.end(), grad_lora.begin(), grad_lora.end());
    return v;
  }
};

void execute(BridgeCall& c) {
  switch (c.kind) {
    case Kind::kForward:
      if (!c.layer.lora.any()) runtime::ThreadPool::global().prewake();  // overlaps the plan
      moe::moe_forward_layer(c.x, c.ids, c.w, c.layer, c.isa, &c.out);
      return;
    case Kind::kForwardTrain: {
      moe::LoraForwardResult r = moe::moe_forward_lora(c.x, c.ids, c.w, c.layer, true);
      c.out.copy_(r.out);
      c.out_gate_pre.copy_(r.gate_pre);
      c.out_up_pre.copy_(r.up_pre);
      return;
    }
    case Kind::kBackward: {
      moe::MoeGrads g = moe::moe_backward_lora(c.grad_output, c.x, c.ids, c.w, c.layer, c.gate_pre,
                                               c.up_pre, c.compute_grad_x);
      c.grad_w.copy_(g.topk_weights);
      if (c.grad_x.defined()) c.grad_x.copy_(g.hidden_states);
      const at::Tensor* grads[6] = {&g.gate_a, &g.gate_b, &g.up_a, &g.up_b, &g.down_a, &g.down_b};
      for (int i = 0; i < 6; ++i)
        if (c.grad_lora[i].defined() && grads[i]->defined()) c.grad_lora[i].copy_(*grads[i]);
      return;
    }
  }
}

// The host function (cudaHostFn_t). Runs on the device runtime's callback
// thread: no device API here, and no exception may escape. A failure (an
// expert id out of range) fills the call's outputs with NaN, so that nothing
// reads stale values as a result, and is raised by the next bridged call.
void run_bridge_call(void* arg) noexcept {
  auto* c = static_cast<BridgeCall*>(arg);
  std::string error;
  try {
    c10::AutoGradMode no_grad(false);
    runtime::PoolThreadsScope pool_threads;  // not an OpenMP team of this thread's own
    // The workers compute; this thread waits, leaving its core to the thread that
    // drives the GPU (runtime::CallerWaitsScope says why).
    runtime::CallerWaitsScope caller_waits(g_caller_waits.load(std::memory_order_relaxed));
    execute(*c);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception";
  }
  if (!error.empty()) {
    record_error(error);
    try {
      for (const at::Tensor& t : c->outputs())
        if (t.defined() && t.numel() > 0) t.fill_(std::numeric_limits<double>::quiet_NaN());
    } catch (...) {
    }
  }
  if (c->delete_after_run) delete c;
}

// Enqueues a call whose staging is declared: acquires its memory, binds the
// views, lets `fill` set the call's tensors from them (and parse the layer:
// every check before anything is enqueued), then copies in, runs, copies out.
template <typename Fill>
void enqueue(Transport& t, Staging& staging, std::unique_ptr<BridgeCall> call, Fill&& fill) {
  call->isa = kernels::active_isa();
  // Two host threads enqueuing on one stream must not interleave their steps:
  // the second call's copies into the shared eager block would land before
  // the first call's host function reads it. Enqueueing never waits on the
  // device, so one lock for all streams costs nothing measurable.
  static std::mutex enqueue_mu;
  std::lock_guard<std::mutex> lock(enqueue_mu);
  const bool capturing = t.capturing();
  void* base = StagingPool::global().acquire(t, staging.bytes());
  staging.bind(base);
  fill(*call);
  BridgeCall* raw = call.get();
  if (capturing) {
    call->delete_after_run = false;
    StagingPool::global().keep_captured_state(std::shared_ptr<BridgeCall>(call.release()));
  }
  staging.copy_in(t);
  t.launch_host_func(&run_bridge_call, raw);
  call.release();  // eager: the host function deletes it; captured: the pool owns it
  staging.copy_out(t);
}

// Stages the routed inputs and the layer's device tensors (LoRA, mask).
struct StagedLayer {
  int x = -1, ids = -1, w = -1, mask = -1;
  std::vector<int> lora;
};

StagedLayer stage_layer(const char* op, Staging& s, const at::Tensor& hidden_states,
                        const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const at::TensorList& lora,
                        const std::optional<at::Tensor>& gpu_experts_mask) {
  TORCH_CHECK(hidden_states.dim() == 2, op, ": hidden_states must be 2-D [T, H], got shape ",
              hidden_states.sizes());
  const at::Device dev = hidden_states.device();
  check_on(op, topk_ids, "topk_ids", dev);
  check_on(op, topk_weights, "topk_weights", dev);
  for (size_t i = 0; i < lora.size(); ++i)
    check_on(op, lora[i], i < 6 ? moe::kLoraFactorNames[i] : "lora", dev);
  if (gpu_experts_mask.has_value()) check_on(op, *gpu_experts_mask, "gpu_experts_mask", dev);
  StagedLayer l;
  l.x = s.input(hidden_states);
  l.ids = s.input(topk_ids);
  l.w = s.input(topk_weights);
  for (const at::Tensor& f : lora) l.lora.push_back(s.input(f));
  if (gpu_experts_mask.has_value()) l.mask = s.input(*gpu_experts_mask);
  return l;
}

// The call's routed inputs and its layer, parsed over the staged views
// (parse_moe_layer: the CPU op's checks).
void bind_layer(BridgeCall& c, const char* op, const Staging& s, const StagedLayer& l,
                KT_LAYER_PARAMS) {
  std::vector<at::Tensor> host_lora;
  for (int i : l.lora) host_lora.push_back(s.host(i));
  std::optional<at::Tensor> host_mask;
  if (l.mask >= 0) host_mask = s.host(l.mask);
  c.layer =
      moe::parse_moe_layer(op, s.host(l.x), s.host(l.ids), s.host(l.w), weights, weight_format,
                           sizes, group_sizes, host_lora, lora_scaling, activation, host_mask);
  c.x = s.host(l.x);
  c.ids = s.host(l.ids);
  c.w = s.host(l.w);
}

at::Tensor device_empty(at::IntArrayRef sizes, const at::Tensor& like, at::ScalarType dtype) {
  return at::empty(sizes, like.options().dtype(dtype));
}

}  // namespace

at::Tensor bridge_moe_forward(Transport& t, const at::Tensor& hidden_states,
                              const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              KT_LAYER_PARAMS, const at::Tensor* out) {
  const char* op = "kt.moe_forward";
  raise_deferred(op, t);
  Staging s;
  const StagedLayer l =
      stage_layer(op, s, hidden_states, topk_ids, topk_weights, lora, gpu_experts_mask);
  at::Tensor result;
  if (out != nullptr) {
    check_on(op, *out, "out", hidden_states.device());
    moe::check_out(op, *out, hidden_states);
    result = *out;
  } else {
    result = device_empty(hidden_states.sizes(), hidden_states, hidden_states.scalar_type());
  }
  const int o = s.output(result);
  enqueue(t, s, std::make_unique<BridgeCall>(), [&](BridgeCall& c) {
    c.kind = Kind::kForward;
    bind_layer(c, op, s, l, KT_LAYER_ARGS);
    c.out = s.host(o);
  });
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bridge_moe_forward_train(
    Transport& t, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  const char* op = "kt.moe_forward_train";
  raise_deferred(op, t);
  Staging s;
  const StagedLayer l =
      stage_layer(op, s, hidden_states, topk_ids, topk_weights, lora, gpu_experts_mask);
  TORCH_CHECK(topk_ids.dim() == 2 && sizes.size() == 2, op,
              ": topk_ids must be [T, K] and sizes [hidden_size, intermediate_size]");
  const int64_t rows = topk_ids.size(0) * topk_ids.size(1);
  at::Tensor out = device_empty(hidden_states.sizes(), hidden_states, hidden_states.scalar_type());
  at::Tensor gate_pre = device_empty({rows, sizes[1]}, hidden_states, at::kFloat);
  at::Tensor up_pre = device_empty({rows, sizes[1]}, hidden_states, at::kFloat);
  const int o = s.output(out), g = s.output(gate_pre), u = s.output(up_pre);
  enqueue(t, s, std::make_unique<BridgeCall>(), [&](BridgeCall& c) {
    c.kind = Kind::kForwardTrain;
    bind_layer(c, op, s, l, KT_LAYER_ARGS);
    c.out = s.host(o);
    c.out_gate_pre = s.host(g);
    c.out_up_pre = s.host(u);
  });
  return {out, gate_pre, up_pre};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> bridge_moe_backward(
    Transport& t, const at::Tensor& grad_output, const at::Tensor& hidden_states,
    const at::Tensor& topk_ids, const at::Tensor& topk_weights, KT_LAYER_PARAMS,
    const std::optional<at::Tensor>& gate_pre, const std::optional<at::Tensor>& up_pre,
    bool compute_grad_hidden_states) {
  const char* op = "kt.moe_backward";
  raise_deferred(op, t);
  Staging s;
  const StagedLayer l =
      stage_layer(op, s, hidden_states, topk_ids, topk_weights, lora, gpu_experts_mask);
  const at::Device dev = hidden_states.device();
  check_on(op, grad_output, "grad_output", dev);
  const int go = s.input(grad_output);
  int gp = -1, up = -1;
  if (gate_pre.has_value()) {
    check_on(op, *gate_pre, "gate_pre", dev);
    gp = s.input(*gate_pre);
  }
  if (up_pre.has_value()) {
    check_on(op, *up_pre, "up_pre", dev);
    up = s.input(*up_pre);
  }
  // Outputs as the CPU op returns them: absent ones are empty [0] tensors in
  // the dtype of hidden_states, computed ones have their input's shape and dtype.
  at::Tensor grad_w = device_empty(topk_weights.sizes(), hidden_states, topk_weights.scalar_type());
  const int gw = s.output(grad_w);
  at::Tensor grad_x =
      compute_grad_hidden_states
          ? device_empty(hidden_states.sizes(), hidden_states, hidden_states.scalar_type())
          : device_empty({0}, hidden_states, hidden_states.scalar_type());
  const int gx = compute_grad_hidden_states ? s.output(grad_x) : -1;
  std::vector<at::Tensor> grad_lora;
  std::array<int, 6> gl{-1, -1, -1, -1, -1, -1};
  for (size_t i = 0; i < lora.size() && i < 6; ++i) {
    const bool absent = lora[i].dim() == 1 && lora[i].numel() == 0;
    grad_lora.push_back(absent
                            ? device_empty({0}, hidden_states, hidden_states.scalar_type())
                            : device_empty(lora[i].sizes(), hidden_states, lora[i].scalar_type()));
    if (!absent) gl[i] = s.output(grad_lora.back());
  }
  enqueue(t, s, std::make_unique<BridgeCall>(), [&](BridgeCall& c) {
    c.kind = Kind::kBackward;
    bind_layer(c, op, s, l, KT_LAYER_ARGS);
    std::optional<at::Tensor> host_gp, host_up;
    if (gp >= 0) host_gp = s.host(gp);
    if (up >= 0) host_up = s.host(up);
    moe::check_backward_args(c.layer.intermediate_size, s.host(go), c.x, c.ids, host_gp, host_up);
    c.grad_output = s.host(go);
    if (host_gp) c.gate_pre = *host_gp;
    if (host_up) c.up_pre = *host_up;
    c.compute_grad_x = compute_grad_hidden_states;
    c.grad_w = s.host(gw);
    if (gx >= 0) c.grad_x = s.host(gx);
    for (int i = 0; i < 6; ++i)
      if (gl[i] >= 0) c.grad_lora[i] = s.host(gl[i]);
  });
  return {grad_x, grad_w, grad_lora};
}

bool set_caller_waits(bool waits) { return g_caller_waits.exchange(waits); }

std::string take_deferred_error() {
  std::lock_guard<std::mutex> lock(g_error_mu);
  std::string msg;
  msg.swap(g_error);
  return msg;
}

}  // namespace kt::hybrid
