// The persistent sm_90a dual GEMM (dual_gemm_sm90.cu), called by the CUDA dual GEMM (dual_gemm.cu).
#pragma once

#include <cuda_runtime.h>

#include "mmfuse/dual_gemm.h"

namespace mmfuse {
namespace detail {

// One expert's checked operands and sizes (out = op(a) @ op(w), [m, n], k the inner size).
struct Sm90Expert {
  const TensorView* a;
  const TensorView* w;
  TensorView* out;
  int64_t m, n, k;
};

// Whether the device is an sm_90 part and this build holds the kernel's sm_90a code.
bool sm90_dual_gemm_supported(int device);

// Both products in one launch. Needs bf16 or fp16 operands, 16-byte-aligned with row strides a
// multiple of 16 bytes, k >= 1 for every non-empty expert, and sizes below 2^31. The workspace
// (dual_gemm_workspace_bytes(), 256-byte aligned) holds the split-k partials of the stream-K
// schedule; with a smaller or undefined one the kernel runs whole tiles.
void sm90_dual_gemm(const Sm90Expert (&experts)[2], const DualGemmOptions& options, const TensorView& workspace,
                    cudaStream_t stream);

}  // namespace detail
}  // namespace mmfuse
