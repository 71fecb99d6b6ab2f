// Elementwise math the CPU handlers share, in plain arithmetic the compiler vectorizes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace conflux {

// exp(x) for the softmax's x <= 0, in plain arithmetic the compiler vectorizes (libm's
// expf is a call per element; -ffast-math would vectorize it, but see paged_attention.py;
// the float-to-int step vectorizes only under -fno-trapping-math).
// x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact to float rounding), then
// exp(r) by its Taylor series to r^7 (truncation < 6e-9 relative) and 2^n from the
// exponent bits. Below -87 the result would leave the normal floats: 0, as exp underflows.
static inline float ExpNonPositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440054690583e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// x * sigmoid(x) (SiLU), for any x: exp only of -|x| (never overflows), then
// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below.
static inline float Silu(float x) {
  const float e = ExpNonPositive(-std::fabs(x));
  return x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e));
}

}  // namespace conflux
