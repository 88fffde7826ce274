#include "moe/expert_weights.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "formats/bf16.h"

namespace kt::moe {

namespace {

// bf16 n16k2 blocks (csrc/formats/bf16.h): packed[nb, kp, r, j] = W[16 nb + r, 2 kp + j].
// Decoded into W^T ([k, n] row-major): the 16 lanes of one (nb, kp) line hold
// W[16 nb + r, 2 kp] in their low and W[16 nb + r, 2 kp + 1] in their high
// halves, i.e. 16 consecutive elements of W^T rows 2 kp and 2 kp + 1. A shift
// and a mask widen them (no shuffle), and the loop over r vectorizes.
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void dequantize_bf16_transposed(const ProjectionWeights& p, int64_t expert, float* wt) {
  constexpr int kRows = formats::kBf16BlockRows;
  const int64_t n = p.n, k = p.k;
  const int64_t blocks = formats::bf16_row_blocks(n);
  const int64_t pairs = formats::bf16_k_pairs(k);
  const int64_t block_elems = formats::bf16_block_elems(k);
  const auto* base =
      reinterpret_cast<const uint16_t*>(p.weight.data_ptr()) + expert * blocks * block_elems;
  constexpr int64_t kLine = kRows * formats::kBf16KPack;  // bf16 values per (nb, kp) line
  const int64_t full_pairs = k / 2;                       // pairs whose odd element is inside k
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
    const uint16_t* block = base + nb * block_elems;
    float* col = wt + nb * kRows;
    if (rows == kRows) {
      // Fixed trip counts: the compiler turns these into shifts, masks and full-line stores.
      for (int64_t kp = 0; kp < full_pairs; ++kp) {
        uint32_t l[kRows];  // 32-bit lanes, read without aliasing the bf16 storage
        std::memcpy(l, block + kp * kLine, sizeof(l));
        float* even = col + 2 * kp * n;
        float* odd = even + n;
        for (int r = 0; r < kRows; ++r) {
          even[r] = bits_to_float(l[r] << 16);
          odd[r] = bits_to_float(l[r] & 0xFFFF0000u);
        }
      }
    } else {
      for (int64_t kp = 0; kp < full_pairs; ++kp) {
        uint32_t l[kRows];
        std::memcpy(l, block + kp * kLine, sizeof(l));
        for (int64_t r = 0; r < rows; ++r) {
          col[2 * kp * n + r] = bits_to_float(l[r] << 16);
          col[(2 * kp + 1) * n + r] = bits_to_float(l[r] & 0xFFFF0000u);
        }
      }
    }
    if (full_pairs < pairs) {  // odd k: the last pair holds one real value
      uint32_t l[kRows];
      std::memcpy(l, block + full_pairs * kLine, sizeof(l));
      for (int64_t r = 0; r < rows; ++r) col[(k - 1) * n + r] = bits_to_float(l[r] << 16);
    }
  }
}

}  // namespace

at::Tensor dense_expert_weight(const ProjectionWeights& p, int64_t expert,
                               const at::Tensor& scratch) {
  TORCH_CHECK(expert >= 0 && expert < p.num_experts(), "dense_expert_weight: expert ", expert,
              " out of range [0, ", p.num_experts(), ")");
  at::Tensor buf = scratch;
  if (buf.defined()) {
    TORCH_CHECK(buf.scalar_type() == at::kFloat && buf.is_contiguous() && buf.numel() >= p.n * p.k,
                "dense_expert_weight: scratch must be a contiguous fp32 tensor of at least ", p.n,
                " x ", p.k, " elements");
  } else {
    buf = at::empty({p.n * p.k}, at::TensorOptions().dtype(at::kFloat));
  }
  if (p.format == "bf16") {
    dequantize_bf16_transposed(p, expert, buf.data_ptr<float>());
    // [k, n] row-major storage, seen as W [n, k] with strides (1, n).
    return buf.narrow(0, 0, p.n * p.k).view({p.k, p.n}).t();
  }
  TORCH_CHECK(false, "dense_expert_weight: weight_format='", p.format,
              "' has no dense decoder yet (LoRA and backward support: 'bf16')");
}

}  // namespace kt::moe
