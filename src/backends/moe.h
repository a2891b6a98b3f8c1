// The moe family's backend entry points, called by src/moe.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/moe.h"

namespace mmfuse {
namespace detail {
// Entries of indices each block of the CUDA plan walks (a multiple of 512); also sizes the workspace.
int64_t moe_plan_block_entries(int64_t tk, int64_t num_experts);

void moe_plan_cpu(const TensorView& indices, int64_t E, int64_t num_out, TensorView& row_id_map, TensorView& counts,
                  TensorView& dst_to_src);
void moe_sort_plan_cpu(const TensorView& indices, int64_t num_out, TensorView& row_id_map);
void moe_permute_cpu(const TensorView& x, const TensorView& row_id_map, TensorView& out);
void moe_unpermute_cpu(const TensorView& y, const TensorView& row_id_map, const TensorView& probs, TensorView& out);
void moe_unpermute_backward_cpu(const TensorView& dout, const TensorView& y, const TensorView& row_id_map,
                                const TensorView& probs, TensorView& dy, TensorView& dprobs);
#ifdef MMFUSE_WITH_CUDA
void moe_plan_cuda(const TensorView& indices, int64_t E, int64_t num_out, TensorView& row_id_map, TensorView& counts,
                   TensorView& dst_to_src, TensorView& workspace, cudaStream_t stream);
int64_t moe_sort_plan_workspace_cuda(int64_t entries);
void moe_sort_plan_cuda(const TensorView& indices, int64_t num_out, TensorView& row_id_map, TensorView& workspace,
                        cudaStream_t stream);
void moe_permute_cuda(const TensorView& x, const TensorView& row_id_map, TensorView& out, cudaStream_t stream);
void moe_unpermute_cuda(const TensorView& y, const TensorView& row_id_map, const TensorView& probs, TensorView& out,
                        cudaStream_t stream);
void moe_unpermute_backward_cuda(const TensorView& dout, const TensorView& y, const TensorView& row_id_map,
                                 const TensorView& probs, TensorView& dy, TensorView& dprobs, TensorView& workspace,
                                 cudaStream_t stream);
#endif
}  // namespace detail

}  // namespace mmfuse
