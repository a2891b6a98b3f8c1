// The fp8 family's backend entry points, called by src/fp8.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/fp8.h"

namespace mmfuse {
namespace detail {
void fp8_quantize_cpu(const Fp8QuantJob& job);
void fp8_transpose_cpu(const TensorView& q, TensorView& qt);
void fp8_gemm_cpu(const TensorView& a, const TensorView& b, const TensorView& scale_a, const TensorView& scale_b,
                  const TensorView& bias, TensorView& out, const Fp8GemmOptions& options);
#ifdef MMFUSE_WITH_CUDA
void fp8_quantize_cuda(Fp8QuantJob* jobs, int num_jobs, cudaStream_t stream);
void fp8_transpose_cuda(const TensorView& q, TensorView& qt, cudaStream_t stream);
void fp8_gemm_cuda(const TensorView& a, const TensorView& b, const TensorView& scale_a, const TensorView& scale_b,
                   const TensorView& bias, TensorView& out, const Fp8GemmOptions& options, TensorView& workspace,
                   cudaStream_t stream);
#endif
}  // namespace detail

}  // namespace mmfuse
