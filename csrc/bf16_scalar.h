// bf16 <-> fp32 (and any stored value to fp32), one value at a time, for the dispatchers' portable code (csrc/<op>.cpp).
// In an anonymous namespace: each translation unit keeps its own copy, so the linker never
// merges one compiled with a SIMD level's flags into code that must run without them (see
// csrc/topk_ip_common.h).
#pragma once
#include <cstdint>
#include <cstring>

namespace ragfast {
namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40u);
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Element i of fp32 values, or of bf16 values (held as uint16_t) when `bf16`, as fp32.
inline float load_float(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// A stored value as fp32: fp32 and int8 by conversion, bf16 (held as uint16_t) by its bits.
template <typename T>
inline float widen(T v) {
  return float(v);
}
template <>
inline float widen<uint16_t>(uint16_t v) {
  return bf16_to_float(v);
}

}  // namespace
}  // namespace ragfast
