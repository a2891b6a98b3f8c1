// One SwiGLU value on the device, rounded once to S: (g * sigmoid(g)) * u in fp32. Shared by the
// swiglu kernels and fp8_quantize's swiglu source, so both give the same bits.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/numerics.cuh"

namespace mmfuse {
namespace cuda {

__device__ __forceinline__ float sigmoid(float g) { return __fdiv_rn(1.0f, add_rn(1.0f, expf(-g))); }

template <class S>
__device__ __forceinline__ S swiglu_value(S gate, S up) {
  const float g = dload(gate);
  return dstore<S>(mul_rn(mul_rn(g, sigmoid(g)), dload(up)));
}

// One element of the backward (the formulas of include/mmfuse/swiglu.h), fp32, each result rounded once.
// Shared by the swiglu backward kernels and fp8_quantize's swiglu_grad source, so both give the same bits.
template <class S, bool kY>
__device__ __forceinline__ void swiglu_grad_value(float gv, float uv, float dv, S& dg, S& du, S& y) {
  const float sig = sigmoid(gv), s = mul_rn(gv, sig);
  const float dsilu = mul_rn(sig, add_rn(1.0f, mul_rn(gv, sub_rn(1.0f, sig))));
  dg = dstore<S>(mul_rn(mul_rn(dv, uv), dsilu));
  du = dstore<S>(mul_rn(dv, s));
  if constexpr (kY) y = dstore<S>(mul_rn(s, uv));
}

// An e4m3 byte of swiglu_pack_fp8's pack times its tile's power-of-two scale: exact (e4m3 values are halves).
__device__ __forceinline__ float swiglu_unpack(uint8_t b, float scale_inv) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3);
  return __fmul_rn(__half2float(__half(h)), scale_inv);
}

}  // namespace cuda
}  // namespace mmfuse
