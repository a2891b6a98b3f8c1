// Host-side storage types for bf16 / fp16 and exact round-to-nearest-even conversions, matching
// what PyTorch (and the CUDA intrinsics __float2bfloat16_rn / __float2half_rn) do for finite values.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mmfuse {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(bf16 v) { return bits_float(uint32_t(v.bits) << 16); }

inline bf16 to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

inline float to_float(f16 v) {
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    float m = std::ldexp(float(man), -24);
    return sign ? -m : m;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline f16 to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below 2^-14: subnormal half, units of 2^-24 (scaling is exact)
    float scaled = bits_float(a) * 16777216.0f;
    return f16{uint16_t(sign | uint16_t(std::nearbyint(scaled)))};
  }
  uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu);
  uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry into the exponent is correct
  return f16{uint16_t(sign | h)};
}

inline float to_float(float v) { return v; }
inline double to_double(double v) { return v; }

// Compute type of a storage type: double for double, float otherwise.
template <class T>
struct compute_type {
  using type = float;
};
template <>
struct compute_type<double> {
  using type = double;
};

// Load a storage value into its compute type; store with round-to-nearest-even.
template <class T>
inline typename compute_type<T>::type load_val(T v) {
  return to_float(v);
}
template <>
inline double load_val<double>(double v) {
  return v;
}
template <class T>
inline T store_val(typename compute_type<T>::type v);
template <>
inline float store_val<float>(float v) {
  return v;
}
template <>
inline double store_val<double>(double v) {
  return v;
}
template <>
inline bf16 store_val<bf16>(float v) {
  return to_bf16(v);
}
template <>
inline f16 store_val<f16>(float v) {
  return to_f16(v);
}

// Round a compute value to the storage type T and back (one rounding of hf_eager numerics).
template <class T>
inline typename compute_type<T>::type round_to(typename compute_type<T>::type v) {
  return load_val<T>(store_val<T>(v));
}

}  // namespace mmfuse
