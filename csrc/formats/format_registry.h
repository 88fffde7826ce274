// The table of weight formats by name (docs/formats.md): what the op layer
// validates a packed projection against and what the kernels are told.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "formats/qint.h"

namespace kt::formats {

enum class FormatKind { kBf16, kQint, kFp8 };

// Whether a format stores explicit zeros (value = scale*q - zero).
enum class ZeroPolicy { kNever, kOptional, kRequired };

struct FormatInfo {
  const char* name;
  FormatKind kind;
  QintFormat qint;                   // kQint: bits, signedness, table, implicit zero offset
  std::vector<int64_t> group_sizes;  // the group_size values the format accepts
  bool scale_is_e8m0;                // mxfp4: uint8 exponents instead of float scales
  ZeroPolicy zeros;
};

// The format called `name`; throws std::invalid_argument listing the known
// names when there is none.
const FormatInfo& lookup_format(const std::string& name);

// "bf16, int8, ..." for error messages.
std::string known_format_names();

}  // namespace kt::formats
