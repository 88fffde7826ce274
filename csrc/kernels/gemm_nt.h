// The backward's fp32 products with the frozen base where they do not run on bf16
// panels (moe/moe_lora.cpp, base_products): an expert's gradient rows d [m, k] times
// an fp32 panel of its weights decoded as W^T (moe/expert_weights.h,
// dense_expert_panel: `n` rows of k floats, row j = column j of W), both read along
// the reduction. A tier that has one computes it with its own FMA tiles (no packing
// copy of the panel, as a BLAS makes per call); elsewhere the BLAS (at::mm) does.
#pragma once

#include <cstdint>

#include "kernels/kernel_api.h"

namespace kt::kernels {

// c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0) + sum_{t < k} a[i * lda + t] *
// b[j * ldb + t], for i < m, j < n. Each sum is the same function of row i of a and row
// j of b wherever (i, j) falls in the kernel's tiles, so results do not depend on how
// the caller splits m or n (thread counts). `next`: lines to prefetch to L2 meanwhile,
// spread over the tiles (the source of the caller's next panel; none when empty).
using GemmNtF32 = void (*)(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                           const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                           const PrefetchChunks& next);

}  // namespace kt::kernels
