// The positions family's backend entry points, called by src/positions.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/positions.h"

namespace mmfuse {
namespace detail {
void rope_index_cpu(const RopeIndexInputs& in, const RopeIndexParams& p, TensorView& position_ids,
                    TensorView& deltas);
void rope_index_cuda(const RopeIndexInputs& in, const RopeIndexParams& p, TensorView& position_ids,
                     TensorView& deltas, TensorView& workspace, cudaStream_t stream);
// Called after validation (grids checked on the host for the CPU, outputs sized).
void vision_positions_cpu(const TensorView& grid, int m, const TensorView& inv_freq, TensorView& positions,
                          TensorView& angles);
void window_index_cpu(const TensorView& grid, int m, int ws, TensorView& window_index, TensorView& reverse_index,
                      TensorView& cu_window_seqlens, TensorView& cu_seqlens);
void vision_positions_cuda(const TensorView& grid, int m, const VisionGridSizes& s, const TensorView& inv_freq,
                           TensorView& positions, TensorView& angles, TensorView& workspace, cudaStream_t stream);
void window_index_cuda(const TensorView& grid, int m, int ws, const VisionGridSizes& s, TensorView& window_index,
                       TensorView& reverse_index, TensorView& cu_window_seqlens, TensorView& cu_seqlens,
                       TensorView& workspace, cudaStream_t stream);
}  // namespace detail

}  // namespace mmfuse
