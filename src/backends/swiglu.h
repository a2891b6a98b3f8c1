// The swiglu family's backend entry points, called by src/swiglu.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/swiglu.h"

namespace mmfuse {
namespace detail {

void swiglu_cpu(const TensorView& gate_up, TensorView& out);
void swiglu_backward_cpu(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y);
#ifdef MMFUSE_WITH_CUDA
void swiglu_cuda(const TensorView& gate_up, TensorView& out, cudaStream_t stream);
void swiglu_backward_cuda(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y,
                          cudaStream_t stream);
#endif

}  // namespace detail
}  // namespace mmfuse
