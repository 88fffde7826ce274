// CUDA tensors reach the kt:: ops on CUDA builds of torch (the dispatcher
// picks the CUDA key when any argument lives there). In a build without the
// CUDA-stream bridge (a CPU torch, or KT_OPS_CUDA_BRIDGE=OFF:
// cmake/cuda_bridge.cmake), one boxed kernel per op names the first CUDA
// argument and its device instead of the dispatcher's generic "could not run
// with arguments from the 'CUDA' backend".
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>

namespace kt::ops {

namespace {

// The name of the first argument holding a CUDA tensor, and its device.
bool find_cuda(const c10::IValue& v, c10::Device* device) {
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_cuda()) {
    *device = v.toTensor().device();
    return true;
  }
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef())
      if (find_cuda(e, device)) return true;
  }
  return false;
}

void cuda_unsupported(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  auto values = torch::jit::last(*stack, args.size());
  std::string name = "an argument";
  c10::Device device(c10::kCUDA);
  for (size_t i = 0; i < args.size(); ++i) {
    if (find_cuda(values[i], &device)) {
      name = args[i].name();
      break;
    }
  }
  TORCH_CHECK(false, "kt.", op.schema().operator_name().name.substr(4), ": ", name, " is on ",
              device,
              "; this kt_ops build runs the experts on the CPU only: move the tensors to the "
              "CPU (hidden_states.cpu()) and the result back");
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CUDA, m) {
  for (const char* name : {"moe_forward", "moe_forward.out", "moe_forward_train", "moe_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_unsupported>());
}

}  // namespace kt::ops
