// Asymmetric dual-expert GEMM (SEMANTICS.md section 6): two independent products in one call,
//   out_e = op(a_e) @ op(w_e)   (out_e += ... with accumulate),   e in {0, 1},
// where the experts may differ in m, n and k. op(a) = a, or a^T with trans_a (a stored [k, m]: the
// weight-gradient form); op(w) = w, or w^T with trans_b (w stored [n, k]: the nn.Linear layout).
//
// Inputs: bf16 or fp16 (the fast paths), fp32 or fp64 (a correct path; fp64 is CPU only, for
// gradcheck), the same dtype for all four; each 2-D with a contiguous last dim (row stride >= its
// columns). Outputs: [m_e, n_e], contiguous, in the input dtype or fp32; accumulate needs fp32
// outputs (gradient accumulation: out_e += op(a_e) @ op(w_e)). Products accumulate in fp32 (fp64
// for fp64) and are rounded once. m, n or k of 0 are valid (k = 0: out = 0, or unchanged with
// accumulate).
//
// Backends: CPU (a reference-quality loop, rows in parallel; the torch binding checks with
// dual_gemm_check and computes the CPU products with ATen's matmul, fp32-accumulating like this
// loop and many times faster); CUDA: cuBLASLt, one matmul an expert on the caller's stream (the
// bigger first), descriptors and algorithms cached per problem, the caller's workspace, no host sync.
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

struct DualGemmOptions {
  bool trans_a = false;
  bool trans_b = false;
  bool accumulate = false;
};

// Bytes of the CUDA workspace (any dtype, contiguous, on the inputs' device; ignored on the CPU). One
// call's workspace must not be in use by another call running at the same time.
MMFUSE_API int64_t dual_gemm_workspace_bytes();

// Every check dual_gemm makes on its arguments (throws mmfuse::Error naming the argument), none of the
// work: for a caller that computes the CPU products with its own GEMM (the torch binding uses ATen's).
MMFUSE_API void dual_gemm_check(const TensorView& a0, const TensorView& w0, const TensorView& out0,
                                const TensorView& a1, const TensorView& w1, const TensorView& out1,
                                const DualGemmOptions& options);

MMFUSE_API void dual_gemm(const TensorView& a0, const TensorView& w0, TensorView& out0, const TensorView& a1,
                          const TensorView& w1, TensorView& out1, const DualGemmOptions& options,
                          TensorView& workspace, cudaStream_t stream);

}  // namespace mmfuse
