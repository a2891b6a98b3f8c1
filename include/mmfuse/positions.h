// Multimodal position preprocessing (SEMANTICS.md sections 3 and 4): rope_index, the 3-D position
// ids of a multimodal batch. (Vision positions and the window index are to follow in this family.)
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

// Which transformers release's results rope_index reproduces, bit for bit.
enum class RopeIndexMode : int {
  kQwen = 0,  // transformers 4.49-4.51 and the Qwen team's code: T = trunc(fp32(fp32(i * sec) * tps))
  kHf4 = 1,   // transformers 4.52-4.57: sec truncated to an integer first: T = trunc(i * int(sec) * tps)
};

struct RopeIndexParams {
  RopeIndexMode mode = RopeIndexMode::kQwen;
  int spatial_merge_size = 2;
  int64_t image_token_id = 151655;
  int64_t video_token_id = 151656;
  int64_t vision_start_token_id = 151652;
  float tokens_per_second = 2.0f;
};

// input_ids [B, L] int32 / int64; attention_mask [B, L] int32 / int64 (1 = valid) or absent (all
// valid); image_grid_thw [Ni, 3] and video_grid_thw [Nv, 3] int32 / int64 (t, h, w in patches) or
// absent; second_per_grid_ts [Nv] float32 or absent (1.0 s). Writes position_ids [3, B, L] int64 and
// deltas [B, 1] int64. Grids are consumed in order across the whole batch.
// Bad input (more spans than grids, a span running past its row or into the next span, h or w not
// divisible by the merge size, a vision start as the last valid token, wrong dtypes, shapes or
// devices) throws mmfuse::Error naming the argument. CPU views only for now.
MMFUSE_API void rope_index(const TensorView& input_ids, const TensorView& attention_mask,
                           const TensorView& image_grid_thw, const TensorView& video_grid_thw,
                           const TensorView& second_per_grid_ts, const RopeIndexParams& params,
                           TensorView& position_ids, TensorView& deltas, cudaStream_t stream);

// Window order of the ViT's window attention (SEMANTICS.md section 4). Per grid (t, h, w) in
// patches, the merged grid h/m x w/m is tiled in ws x ws windows (ws = window_size / m / patch_size;
// the last row / column of windows may be partial), listed frame by frame, window-row-major, merged
// tokens row-major inside a window. window_index lists merged-token indices (grids offset by their
// running token count) in that order; cu_window_seqlens is the running sum of each window's patch
// count (valid_h * valid_w * m^2) from 0, with no zero-length window. Sizes are pure functions of the
// grids: window_index_sizes gives them from a host copy of grid_thw.
struct WindowIndexSizes {
  int64_t tokens;   // merged tokens: sum t * (h/m) * (w/m)
  int64_t windows;  // windows with at least one token
};
MMFUSE_API WindowIndexSizes window_index_sizes(const TensorView& grid_thw, int spatial_merge_size, int window_size,
                                               int patch_size);
// grid_thw [n, 3] int32 / int64 on the CPU; window_index [tokens] int64, cu_window_seqlens
// [windows + 1] int32, CPU views (the CUDA backend is to follow).
MMFUSE_API void window_index(const TensorView& grid_thw, int spatial_merge_size, int window_size, int patch_size,
                             TensorView& window_index, TensorView& cu_window_seqlens, cudaStream_t stream);

namespace detail {
void rope_index_cpu(const TensorView& input_ids, const TensorView& attention_mask, const TensorView& image_grid_thw,
                    const TensorView& video_grid_thw, const TensorView& second_per_grid_ts,
                    const RopeIndexParams& p, TensorView& position_ids, TensorView& deltas);
// Called after validation (grids checked, outputs sized): ws = window side in merged tokens.
void window_index_cpu(const TensorView& grid_thw, int spatial_merge_size, int ws, TensorView& window_index,
                      TensorView& cu_window_seqlens);
}  // namespace detail

}  // namespace mmfuse
