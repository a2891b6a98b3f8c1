// The dual_gemm family's backend entry points, called by src/dual_gemm.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/dual_gemm.h"

namespace mmfuse {
namespace detail {
// One product on the CPU: out (+)= op(a) @ op(w), shapes already checked.
void gemm_cpu(const TensorView& a, const TensorView& w, TensorView& out, const DualGemmOptions& options);
#ifdef MMFUSE_WITH_CUDA
void dual_gemm_cuda(const TensorView& a0, const TensorView& w0, TensorView& out0, const TensorView& a1,
                    const TensorView& w1, TensorView& out1, const DualGemmOptions& options, TensorView& workspace,
                    cudaStream_t stream);
#endif
}  // namespace detail

}  // namespace mmfuse
