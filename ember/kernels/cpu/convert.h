// float32 <-> the model dtype, written so that the compiler vectorizes the loops they sit
// in: c10's BFloat16 conversions are correct but scalar. bfloat16 is the top half of a
// float32; rounding is to nearest even, as c10's (NaN payloads aside).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace ember_cpu {

template <typename T>
inline float load(const T& v) {
  return static_cast<float>(v);
}

template <>
inline float load(const at::BFloat16& v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

template <typename T>
inline T store(float v) {
  return static_cast<T>(v);
}

template <>
inline at::BFloat16 store(float v) {
  uint32_t word;
  std::memcpy(&word, &v, sizeof(word));
  word += 0x7FFFu + ((word >> 16) & 1u);
  const uint16_t bits = static_cast<uint16_t>(word >> 16);
  at::BFloat16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// v rounded to T and back: where the plain-torch code rounds an intermediate
template <typename T>
inline float round_to(float v) {
  return load<T>(store<T>(v));
}

}  // namespace ember_cpu
