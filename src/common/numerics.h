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

// FP8 (OCP e4m3 "fn": bias 7, max 448, no inf, NaN 0x7f; e5m2: bias 15, max 57344) on the host:
// round to nearest even with saturation to the largest finite value (what the CUDA conversion
// __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...) does); NaN becomes 0x7f (sign kept).
inline uint8_t float_to_fp8(float f, bool e4m3) {
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const uint8_t max_code = e4m3 ? 0x7e : 0x7b;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  const float a = std::fabs(f);
  if (std::isinf(a)) return uint8_t(sign | max_code);
  const int emin = 1 - bias;  // exponent of the smallest normal
  uint32_t code;
  if (a < std::ldexp(1.0f, emin)) {  // subnormal: units of 2^(emin - mbits); 2^mbits units is the smallest normal
    code = uint32_t(std::nearbyint(std::ldexp(a, mbits - emin)));
  } else {
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    --e;                                // a = (2m) * 2^e, 2m in [1, 2)
    if (e + bias > 30) return uint8_t(sign | max_code);  // far beyond the range
    const uint32_t frac = uint32_t(std::nearbyint(std::ldexp(2.0f * m - 1.0f, mbits)));  // may carry
    code = (uint32_t(e + bias) << mbits) + frac;
  }
  return uint8_t(sign | (code > max_code ? max_code : code));
}

// The fp8 rule for non-finite input (SEMANTICS.md section 7): amax is taken over the finite values
// only, and an Inf or NaN element quantizes to NaN, so that only the outputs that read it are
// non-finite (as F.linear's), and one bad tensor does not set the scale of the others or of the
// delayed history.
inline float fp8_finite_abs(float v) {
  const float a = std::fabs(v);
  return a <= 3.4028234663852886e38f ? a : 0.0f;  // NaN and Inf: 0
}
inline float fp8_scaled(float v, float scale) { return std::isinf(v) ? std::nanf("") : v * scale; }

inline float fp8_to_float(uint8_t b, bool e4m3) {
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
  float v;
  if (e4m3 && (b & 0x7f) == 0x7f) v = std::nanf("");
  else if (!e4m3 && e == 31) v = m ? std::nanf("") : INFINITY;
  else if (e == 0) v = std::ldexp(float(m), 1 - bias - mbits);
  else v = std::ldexp(1.0f + std::ldexp(float(m), -mbits), e - bias);
  return (b & 0x80) ? -v : v;
}

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
