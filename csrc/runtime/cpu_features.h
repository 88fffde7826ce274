// CPU feature detection (CPUID plus OS enablement of the register state).
#pragma once

namespace kt::runtime {

struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA + F16C
  bool avx512 = false;       // AVX-512 F/BW/VL/DQ, OS-enabled (XCR0 opmask/ZMM state)
  bool avx512_vnni = false;  // AVX512_VNNI
  bool avx512_bf16 = false;  // AVX512_BF16
  bool avx512_vbmi = false;  // AVX512_VBMI (byte permutes: the fp8 tile decode's tables)
  bool amx = false;          // AMX-TILE + AMX-BF16 + AMX-INT8 (reported only)
  // A GenuineIntel CPU: its vdpbf16ps runs at a quarter of its FMA's instruction rate
  // (the brgemm thresholds' CPU class, formats::BrgemmIsa::kAvx512Intel).
  bool intel = false;
};

// Detected once, on first use.
const CpuFeatures& cpu_features();

}  // namespace kt::runtime
