// Device storage/compute types and explicitly rounded arithmetic (no FMA contraction), shared by the
// CUDA backends. Host storage types (common/numerics.h) map onto CUDA's types here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/numerics.h"

namespace mmfuse {
namespace cuda {

template <class T>
struct device_type {
  using type = T;
};
template <>
struct device_type<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct device_type<f16> {
  using type = __half;
};

// The compute type of a storage type: common/numerics.h's, for the device types too (float but for double).
using mmfuse::compute_type;

__device__ __forceinline__ float dload(float v) { return v; }
__device__ __forceinline__ double dload(double v) { return v; }
__device__ __forceinline__ float dload(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float dload(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T dstore(typename compute_type<T>::type v);
template <>
__device__ __forceinline__ float dstore<float>(float v) { return v; }
template <>
__device__ __forceinline__ double dstore<double>(double v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 dstore<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half dstore<__half>(float v) { return __float2half_rn(v); }

template <class T>
__device__ __forceinline__ typename compute_type<T>::type dround(typename compute_type<T>::type v) {
  return dload(dstore<T>(v));
}

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

__device__ __forceinline__ void sincos_c(float a, float* s, float* c) { sincosf(a, s, c); }
__device__ __forceinline__ void sincos_c(double a, double* s, double* c) { sincos(a, s, c); }

// VEC consecutive elements moved with one access (16 bytes for the full vector width).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// The fp8 rule for non-finite input (common/numerics.h fp8_finite_abs / fp8_scaled): amax over the
// finite values; Inf and NaN elements quantize to NaN.
__device__ __forceinline__ float fp8_finite_abs(float v) {
  const float a = fabsf(v);
  return a <= 3.4028234663852886e38f ? a : 0.0f;
}
__device__ __forceinline__ float fp8_scaled(float v, float s) {
  return fabsf(v) == __int_as_float(0x7f800000) ? __int_as_float(0x7fffffff) : __fmul_rn(v, s);
}

}  // namespace cuda
}  // namespace mmfuse
