// torch.classes.kt.PreparedLayer: one layer's arguments parsed once, the
// first argument of kt::moe_forward_prepared (csrc/ops/prepared_layer.cpp says
// why it exists).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "moe/moe_layer.h"

namespace kt::ops {

class PreparedLayer : public torch::CustomClassHolder {
 public:
  // The op's layer arguments without LoRA; gpu_experts_mask (contiguous CPU
  // bool [E], or None) is read at every call; top_k > 0: calls must route
  // that many experts per token.
  PreparedLayer(const c10::List<std::optional<at::Tensor>>& weights,
                const std::string& weight_format, const std::vector<int64_t>& sizes,
                const std::vector<int64_t>& group_sizes, const std::string& activation,
                const std::optional<at::Tensor>& gpu_experts_mask, int64_t top_k);

  // kt.moe_forward's output for the routed tensors (its checks and messages).
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                     const at::Tensor& topk_weights) const;

  // The constructor's arguments again (pickling, copying: torch.compile copies
  // the script objects it traces).
  using State = std::tuple<c10::List<std::optional<at::Tensor>>, std::string, std::vector<int64_t>,
                           std::vector<int64_t>, std::string, std::optional<at::Tensor>, int64_t>;
  State state() const { return state_; }

  int64_t num_experts() const { return num_experts_; }
  int64_t hidden_size() const { return hidden_size_; }
  int64_t top_k() const { return std::get<6>(state_); }
  // (name, value) pairs of what the fake class needs: num_experts, hidden_size, top_k.
  std::tuple<std::tuple<std::string, int64_t>, std::tuple<std::string, int64_t>,
             std::tuple<std::string, int64_t>>
  flatten() const;

 private:
  // A packed tensor's data as parsed: a tensor keeps its identity through
  // `.data = t`, set_(), resize_() and share_memory_(), which change these.
  struct Storage {
    const void* data;
    std::vector<int64_t> sizes, strides;
  };
  // The parsed layer and the storage it points into; replaced (under refresh_)
  // when a call finds the storage changed.
  struct Parsed {
    moe::MoeLayer layer;
    std::vector<Storage> made_from;
  };
  std::shared_ptr<const Parsed> parse() const;
  std::shared_ptr<const Parsed> current() const;

  State state_;
  int64_t num_experts_ = 0, hidden_size_ = 0;
  mutable std::mutex refresh_;
  mutable std::shared_ptr<const Parsed> parsed_;
};

// In the TORCH_LIBRARY(kt) block (csrc/ops/registration.cpp), in this order:
// the class, then the schema that names it, then its CPU and Autograd kernels.
// (A TORCH_LIBRARY_IMPL of its own would infer the kernels' schema when this
// file's static initializers run, perhaps before the class exists.)
void register_prepared_layer_class(torch::Library& m);
void register_prepared_layer_kernels(torch::Library& m);

// kt_ops._C.moe_forward_prepared: the op through the dispatcher, entered from C++
// (python_bindings.cpp; prepared_layer.cpp says why).
void register_prepared_layer_call(pybind11::module& m);

}  // namespace kt::ops
