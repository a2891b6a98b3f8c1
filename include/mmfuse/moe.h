// MoE token routing (SEMANTICS.md section 5): the routing plan (a stable counting sort of the expert
// ids), permute, unpermute with probabilities, and their backward; CPU and CUDA backends.
//
// Permuted order: ascending expert id, then ascending flat index i = t*K + k (a stable sort of the
// flattened ids). The first num_out rows of that order are kept, the rest dropped.
//
// Workspaces are int32 buffers of the size the *_workspace_size functions give, owned by the caller
// (the core allocates nothing); their contents need no initialisation and are scratch afterwards.
//
// CUDA kernels are chosen per call by the shapes (src/cuda/moe/path.h; docs/design/moe.md says why);
// every path gives the same bits, except dprobs of the general backward kernel (another fp32
// summation order), which only calls past 2^31 entries take.
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

// Experts the CUDA plan supports (its per-block histograms live in shared memory).
constexpr int64_t kMoeMaxExpertsCuda = 4096;

// int32 elements of the plan's workspace (the CPU backend needs none; the size is the same for both).
// On the GPU a workspace 16-byte aligned lets plans of 512 experts and more take 16-bit histograms.
MMFUSE_API int64_t moe_plan_workspace_size(int64_t tokens, int64_t topk, int64_t num_experts);

// indices [T, K] int32 / int64, ids in [0, num_experts); num_out_tokens: 0 or T*K keeps all.
// Writes row_id_map int32 [K, T] (row_id_map[k][t] = destination row of (t, k), -1 if dropped),
// counts int64 [num_experts] (kept rows per expert) and dst_to_src int32 [num_out] (the flat index
// t*K + k of each destination row). An id outside [0, num_experts) is an error naming it: an
// exception on the CPU, a message and a device-side assertion on the GPU (no out-of-bounds access).
MMFUSE_API void moe_plan(const TensorView& indices, int64_t num_experts, int64_t num_out_tokens,
                         TensorView& row_id_map, TensorView& counts, TensorView& dst_to_src, TensorView& workspace,
                         cudaStream_t stream);

// int32 elements of moe_sort_plan's CUDA workspace for T*K entries (the radix sort's keys and values,
// in and out, and its scratch); the CPU backend needs none. Queries the current CUDA device.
MMFUSE_API int64_t moe_sort_plan_workspace_size(int64_t tokens, int64_t topk);

// moe_plan's row_id_map without an expert count (the seed API's permute has none): the same order
// (ascending id, then flat index), on the GPU from a radix sort of the ids (no host sync). Ids may be
// any value in [0, 2^31); a negative id or an int64 id past that is an error naming it, as in moe_plan.
MMFUSE_API void moe_sort_plan(const TensorView& indices, int64_t num_out_tokens, TensorView& row_id_map,
                              TensorView& workspace, cudaStream_t stream);

// out [N, H]: out[row_id_map[k][t]] = x[t] for every kept (t, k); each x row is read once. Any
// dtype (rows are copied as bytes: bf16, fp16, fp32, fp8 ...). A plan's map covers all its num_out
// rows; rows of out no entry maps to are not written. The last dims contiguous.
MMFUSE_API void moe_permute(const TensorView& x, const TensorView& row_id_map, TensorView& out, cudaStream_t stream);

// out [T, H] = sum over kept k of probs[t, k] * y[row_id_map[k][t]] (weights 1 without probs),
// accumulated in fp32 (fp64 for fp64) in k order and rounded once: CPU and CUDA bitwise equal.
// y [N, H] bf16 / fp16 / fp32 / fp64; probs [T, K] fp32 or absent. Without probs this is also the
// backward of permute.
MMFUSE_API void moe_unpermute(const TensorView& y, const TensorView& row_id_map, const TensorView& probs,
                              TensorView& out, cudaStream_t stream);

// int32 elements of the unpermute backward's workspace for y with `rows` rows (a write count a row).
MMFUSE_API int64_t moe_unpermute_backward_workspace_size(int64_t rows);

// Backward of unpermute: dy [N, H] (dy[row(t,k)] = probs[t,k] * dout[t], rounded once; rows no kept
// (t, k) maps to are zero) and dprobs [T, K] fp32 (dot(dout[t], y[row(t,k)]) accumulated in fp32, 0
// when dropped; optional: absent skips reading y). Two entries mapping to one row are an error.
MMFUSE_API void moe_unpermute_backward(const TensorView& dout, const TensorView& y, const TensorView& row_id_map,
                                       const TensorView& probs, TensorView& dy, TensorView& dprobs,
                                       TensorView& workspace, cudaStream_t stream);

}  // namespace mmfuse
