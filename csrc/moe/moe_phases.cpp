#include "moe/moe_phases.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "formats/bf16.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

namespace {

// Rows of activations converted per pool task.
constexpr int64_t kRowsPerConvertTask = 8;

template <class Src>
void convert_rows(const Src* src, int64_t H, int64_t Hp, float* dst, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const Src* s = src + t * H;
    float* d = dst + t * Hp;
    for (int64_t j = 0; j < H; ++j) d[j] = static_cast<float>(s[j]);
    for (int64_t j = H; j < Hp; ++j) d[j] = 0.0f;
  }
}

// fp32 sums of one output row; grown once per thread, never per task.
thread_local std::vector<float> t_combine_acc;

template <class Dst>
void combine_rows(const float* y, const uint8_t* valid, int64_t K, int64_t H, Dst* out,
                  int64_t begin, int64_t end) {
  grow(t_combine_acc, H);
  float* acc = t_combine_acc.data();
  for (int64_t t = begin; t < end; ++t) {
    std::fill(acc, acc + H, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      if (!valid[t * K + k]) continue;
      const float* yk = y + (t * K + k) * H;
      for (int64_t j = 0; j < H; ++j) acc[j] += yk[j];
    }
    Dst* o = out + t * H;
    for (int64_t j = 0; j < H; ++j) o[j] = static_cast<Dst>(acc[j]);
  }
}

}  // namespace

void convert_activations(const at::Tensor& hidden_states, int64_t Hp, float* x) {
  const int64_t T = hidden_states.size(0);
  const int64_t H = hidden_states.size(1);
  runtime::ThreadPool::global().run(
      formats::ceil_div(T, kRowsPerConvertTask), [&](int64_t task, int) {
        const int64_t b = task * kRowsPerConvertTask;
        const int64_t e = std::min(T, b + kRowsPerConvertTask);
        switch (hidden_states.scalar_type()) {
          case at::kFloat:
            convert_rows(hidden_states.data_ptr<float>(), H, Hp, x, b, e);
            break;
          case at::kBFloat16:
            convert_rows(hidden_states.data_ptr<c10::BFloat16>(), H, Hp, x, b, e);
            break;
          default:
            convert_rows(hidden_states.data_ptr<c10::Half>(), H, Hp, x, b, e);
            break;
        }
      });
}

void combine_slots(const float* y, const RoutingPlan& plan, at::Tensor& out) {
  const int64_t T = out.size(0);
  const int64_t H = out.size(1);
  const int64_t K = plan.top_k;
  const uint8_t* valid = plan.slot_valid.data();
  runtime::ThreadPool::global().run(
      formats::ceil_div(T, kRowsPerConvertTask), [&](int64_t task, int) {
        const int64_t b = task * kRowsPerConvertTask;
        const int64_t e = std::min(T, b + kRowsPerConvertTask);
        switch (out.scalar_type()) {
          case at::kFloat:
            combine_rows(y, valid, K, H, out.data_ptr<float>(), b, e);
            break;
          case at::kBFloat16:
            combine_rows(y, valid, K, H, out.data_ptr<c10::BFloat16>(), b, e);
            break;
          default:
            combine_rows(y, valid, K, H, out.data_ptr<c10::Half>(), b, e);
            break;
        }
      });
}

}  // namespace kt::moe
