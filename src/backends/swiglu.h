// The swiglu family's backend entry points, called by src/swiglu.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include <cmath>

#include "common/numerics.h"
#include "mmfuse/swiglu.h"

namespace mmfuse {
namespace detail {

// One SwiGLU value on the CPU, rounded once to S: silu(g) * u as (g * sigmoid(g)) * u in S's compute
// type. Shared by the swiglu kernels and fp8_quantize's swiglu source, so both give the same bits.
template <class S>
inline S swiglu_value_cpu(S gate, S up) {
  using C = typename compute_type<S>::type;
  const C g = load_val(gate), u = load_val(up);
  const C sig = C(1) / (C(1) + std::exp(-g));
  return store_val<S>(g * sig * u);
}

void swiglu_cpu(const TensorView& gate_up, TensorView& out);
void swiglu_backward_cpu(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y);
#ifdef MMFUSE_WITH_CUDA
void swiglu_cuda(const TensorView& gate_up, TensorView& out, cudaStream_t stream);
void swiglu_backward_cuda(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y,
                          cudaStream_t stream);
#endif

}  // namespace detail
}  // namespace mmfuse
