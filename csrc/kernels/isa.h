// ISA tiers of the kernels, lowest to highest.
#pragma once

#include <string>
#include <vector>

namespace kt::kernels {

enum class Isa { kRef = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

const char* isa_name(Isa isa);
// Parses "ref" | "avx2" | "avx512" | "avx512_vnni"; throws std::invalid_argument otherwise.
Isa parse_isa(const std::string& name);

}  // namespace kt::kernels
