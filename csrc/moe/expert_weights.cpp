#include "moe/expert_weights.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "formats/bf16.h"

namespace kt::moe {

namespace {

// bf16 n16k2 blocks (csrc/formats/bf16.h): packed[nb, kp, r, j] = W[16 nb + r, 2 kp + j].
// Rows are written in order; the block being read ([kp][16][2], at most a
// few tens of KB) stays in cache while its 16 rows are filled.
void dequantize_bf16(const ProjectionWeights& p, int64_t expert, float* out) {
  const int64_t n = p.n, k = p.k;
  const int64_t blocks = formats::bf16_row_blocks(n);
  const int64_t pairs = formats::bf16_k_pairs(k);
  const int64_t block_elems = formats::bf16_block_elems(k);
  const auto* base =
      reinterpret_cast<const uint16_t*>(p.weight.data_ptr()) + expert * blocks * block_elems;
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const uint16_t* block = base + nb * block_elems;
    const int64_t rows =
        std::min<int64_t>(formats::kBf16BlockRows, n - nb * formats::kBf16BlockRows);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = out + (nb * formats::kBf16BlockRows + r) * k;
      const uint16_t* src = block + r * formats::kBf16KPack;
      const int64_t full_pairs = k / 2;
      for (int64_t kp = 0; kp < full_pairs; ++kp) {
        const uint16_t* s = src + kp * (formats::kBf16BlockRows * formats::kBf16KPack);
        dst[2 * kp] = formats::bf16_bits_to_float(s[0]);
        dst[2 * kp + 1] = formats::bf16_bits_to_float(s[1]);
      }
      if (full_pairs < pairs) {  // odd k: the last pair holds one real value
        dst[k - 1] = formats::bf16_bits_to_float(
            src[full_pairs * (formats::kBf16BlockRows * formats::kBf16KPack)]);
      }
    }
  }
}

}  // namespace

void dense_expert_weight_out(const ProjectionWeights& p, int64_t expert, const at::Tensor& out) {
  TORCH_CHECK(expert >= 0 && expert < p.num_experts(), "dense_expert_weight: expert ", expert,
              " out of range [0, ", p.num_experts(), ")");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == p.n * p.k,
              "dense_expert_weight: out must be a contiguous fp32 tensor of ", p.n, " x ", p.k,
              " elements");
  float* dst = out.data_ptr<float>();
  if (p.format == "bf16") {
    dequantize_bf16(p, expert, dst);
    return;
  }
  TORCH_CHECK(false, "dense_expert_weight: weight_format='", p.format,
              "' has no dense decoder yet (LoRA and backward support: 'bf16')");
}

at::Tensor dense_expert_weight(const ProjectionWeights& p, int64_t expert) {
  at::Tensor out = at::empty({p.n, p.k}, at::TensorOptions().dtype(at::kFloat));
  dense_expert_weight_out(p, expert, out);
  return out;
}

}  // namespace kt::moe
