// ISA tiers of the kernels. A tier is its rank in the tier table of
// dispatch.cpp (0 = ref, the portable path; higher ranks need more of the
// CPU); names ("avx2", "avx512_vnni", ...) come from that table.
#pragma once

#include <string>

namespace kt::kernels {

using Isa = int;

// The name of tier `isa` ("ref", "avx2", ...).
const char* isa_name(Isa isa);
// The tier called `name`; throws std::invalid_argument listing the known ones.
Isa parse_isa(const std::string& name);

}  // namespace kt::kernels
