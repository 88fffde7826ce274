#include "formats/format_registry.h"

#include <stdexcept>

namespace kt::formats {

namespace {

QintFormat qint(int bits, bool is_signed, bool lut, float zero_offset) {
  QintFormat f;
  f.bits = bits;
  f.is_signed = is_signed;
  f.lut_e2m1 = lut;
  f.zero_offset = zero_offset;
  return f;
}

const std::vector<FormatInfo>& table() {
  static const std::vector<FormatInfo> formats = {
      {"bf16", FormatKind::kBf16, {}, {0}, false, ZeroPolicy::kNever},
      // Symmetric per output channel; q8 activations.
      {"int8", FormatKind::kQint, qint(8, true, false, 0.f), {0}, false, ZeroPolicy::kNever},
      // Groups along K; symmetric (implicit zero 8) or asymmetric (zeros).
      {"int4",
       FormatKind::kQint,
       qint(4, false, false, 8.f),
       {32, 64, 128},
       false,
       ZeroPolicy::kOptional},
      {"fp8", FormatKind::kFp8, {}, {128}, false, ZeroPolicy::kNever},
      // OCP MX: E2M1 codes, one UE8M0 exponent per 32; kernel codes 2v + 12.
      {"mxfp4", FormatKind::kQint, qint(4, false, true, 12.f), {32}, true, ZeroPolicy::kNever},
      // GGUF block types (ggml-common.h), repacked losslessly.
      {"q8_0", FormatKind::kQint, qint(8, true, false, 0.f), {32}, false, ZeroPolicy::kNever},
      {"q4_0", FormatKind::kQint, qint(4, false, false, 8.f), {32}, false, ZeroPolicy::kNever},
      {"q4_k", FormatKind::kQint, qint(4, false, false, 0.f), {32}, false, ZeroPolicy::kRequired},
      {"q5_k", FormatKind::kQint, qint(5, false, false, 0.f), {32}, false, ZeroPolicy::kRequired},
      {"q6_k", FormatKind::kQint, qint(6, false, false, 32.f), {16}, false, ZeroPolicy::kNever},
  };
  return formats;
}

}  // namespace

std::string known_format_names() {
  std::string names;
  for (const FormatInfo& f : table()) {
    if (!names.empty()) names += ", ";
    names += f.name;
  }
  return names;
}

const FormatInfo& lookup_format(const std::string& name) {
  for (const FormatInfo& f : table())
    if (name == f.name) return f;
  throw std::invalid_argument("weight_format='" + name +
                              "' is not a kt_ops format; expected one of " + known_format_names());
}

}  // namespace kt::formats
