// One SwiGLU value on the device, rounded once to S: (g * sigmoid(g)) * u in fp32. Shared by the
// swiglu kernels and fp8_quantize's swiglu source, so both give the same bits.
#pragma once

#include "cuda/numerics.cuh"

namespace mmfuse {
namespace cuda {

__device__ __forceinline__ float sigmoid(float g) { return __fdiv_rn(1.0f, add_rn(1.0f, expf(-g))); }

template <class S>
__device__ __forceinline__ S swiglu_value(S gate, S up) {
  const float g = dload(gate);
  return dstore<S>(mul_rn(mul_rn(g, sigmoid(g)), dload(up)));
}

}  // namespace cuda
}  // namespace mmfuse
