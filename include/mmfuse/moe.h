// MoE token routing (SEMANTICS.md section 5): the routing plan (a stable counting sort of the expert
// ids), permute, unpermute with probabilities, and their backward. CPU backend for now (the CUDA
// backend is issue 4's next step).
//
// Permuted order: ascending expert id, then ascending flat index i = t*K + k (a stable sort of the
// flattened ids). The first num_out rows of that order are kept, the rest dropped.
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

// indices [T, K] int32 / int64, ids in [0, num_experts); num_out_tokens: 0 or T*K keeps all.
// Writes row_id_map int32 [K, T] (row_id_map[k][t] = destination row of (t, k), -1 if dropped),
// counts int64 [num_experts] (kept rows per expert) and dst_to_src int32 [num_out] (the flat index
// t*K + k of each destination row). An id outside [0, num_experts) throws, naming it.
MMFUSE_API void moe_plan(const TensorView& indices, int64_t num_experts, int64_t num_out_tokens,
                         TensorView& row_id_map, TensorView& counts, TensorView& dst_to_src, cudaStream_t stream);

// out [num_out, H] = x [T, H] rows in permuted order: out[d] = x[dst_to_src[d] / K]. Any dtype (rows
// are copied as bytes: bf16, fp16, fp32, fp8 ...); the last dim contiguous.
MMFUSE_API void moe_permute(const TensorView& x, const TensorView& dst_to_src, int64_t topk, TensorView& out,
                            cudaStream_t stream);

// out [T, H] = sum over kept k of probs[t, k] * y[row_id_map[k][t]] (weights 1 without probs),
// accumulated in fp32 (fp64 for fp64) in k order and rounded once. y [N, H] bf16 / fp16 / fp32 / fp64;
// probs [T, K] fp32 or absent. This is also the backward of permute (without probs).
MMFUSE_API void moe_unpermute(const TensorView& y, const TensorView& row_id_map, const TensorView& probs,
                              TensorView& out, cudaStream_t stream);

// Backward of unpermute: dy [N, H] (dy[row(t,k)] = probs[t,k] * dout[t]; rows no kept (t, k) maps to
// are zero) and dprobs [T, K] fp32 (dot(dout[t], y[row(t,k)]) in fp32, 0 when dropped; optional).
MMFUSE_API void moe_unpermute_backward(const TensorView& dout, const TensorView& y, const TensorView& row_id_map,
                                       const TensorView& probs, TensorView& dy, TensorView& dprobs,
                                       cudaStream_t stream);

namespace detail {
void moe_plan_cpu(const TensorView& indices, int64_t E, int64_t num_out, TensorView& row_id_map, TensorView& counts,
                  TensorView& dst_to_src);
void moe_permute_cpu(const TensorView& x, const TensorView& dst_to_src, int64_t topk, TensorView& out);
void moe_unpermute_cpu(const TensorView& y, const TensorView& row_id_map, const TensorView& probs, TensorView& out);
void moe_unpermute_backward_cpu(const TensorView& dout, const TensorView& y, const TensorView& row_id_map,
                                const TensorView& probs, TensorView& dy, TensorView& dprobs);
}  // namespace detail

}  // namespace mmfuse
