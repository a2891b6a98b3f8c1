// Multimodal position preprocessing (SEMANTICS.md sections 3 and 4): rope_index (the 3-D position ids
// of a multimodal batch), vision positions / rot_pos_emb and the ViT window index.
//
// CUDA backends: no host sync, no allocation (the caller passes a small workspace), static output
// shapes. Bad input the host cannot see (it lives in device tensors) stops the kernel with a
// device-side assertion after printing the problem ("mmfuse.rope_index: row 3: ..."), as PyTorch's
// own index checks do; it never reads or writes out of bounds. CPU backends throw mmfuse::Error.
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

// Which transformers release's results rope_index reproduces, bit for bit.
enum class RopeIndexMode : int {
  kQwen = 0,  // transformers 4.49-4.51 and the Qwen team's code: T = trunc(fp32(fp32(i * sec) * tps))
  kHf4 = 1,   // transformers 4.52-4.57: sec truncated to an integer first: T = trunc(i * int(sec) * tps)
  kHf5 = 2,   // transformers 5.x (5.3+): spans = runs of mm_token_type_ids; see SEMANTICS.md section 3
};

struct RopeIndexParams {
  RopeIndexMode mode = RopeIndexMode::kQwen;
  int spatial_merge_size = 2;
  int64_t image_token_id = 151655;
  int64_t video_token_id = 151656;
  int64_t vision_start_token_id = 151652;
  float tokens_per_second = 2.0f;
};

// input_ids [B, L] int32 / int64; attention_mask [B, L] int32 / int64 or absent (all valid; valid
// means == 1 in qwen / hf4 and != 0 in hf5); mm_token_type_ids [B, L] int32 / int64 (0 text, 1 image,
// 2 video), hf5 only; image_grid_thw [Ni, 3] and video_grid_thw [Nv, 3] int32 / int64 (t, h, w in
// patches) or absent; second_per_grid_ts [Nv] float32 or absent (1.0 s). All on one device.
struct RopeIndexInputs {
  TensorView input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw, second_per_grid_ts;
};

// int32 elements of the CUDA workspace of rope_index (per-row span counts); none on the CPU.
MMFUSE_API int64_t rope_index_workspace_size(int64_t batch);

// Writes position_ids [3, B, L] int64 and deltas [B, 1] int64. Grids are consumed in order across
// the whole batch. Bad input: more spans than grids, a span running past its row or into the next
// span (hf5: a run whose length is not its grid's token count), h or w not divisible by the merge
// size, a vision start as the last valid token (qwen / hf4). Two launches on `stream` for CUDA views.
MMFUSE_API void rope_index(const RopeIndexInputs& in, const RopeIndexParams& params, TensorView& position_ids,
                           TensorView& deltas, TensorView& workspace, cudaStream_t stream);

// ---- vision: patch positions, rot_pos_emb and the window index -------------------------------
// Patches come in spatial-merge-block order: for each m x m block (block-row-major) its m*m patches
// row-major inside the block; frames repeat the layout. Output sizes are pure functions of the grids:
// vision_grid_sizes computes them from a host copy of grid_thw [n, 3] (int32 / int64, h and w
// divisible by m), validating it.
struct VisionGridSizes {
  int64_t grids = 0;
  int64_t frames = 0;             // sum t: segments of full attention
  int64_t patches = 0;            // sum t*h*w
  int64_t tokens = 0;             // merged tokens: patches / m^2
  int64_t windows = 0;            // windows with at least one token (0 when window_side is 0)
  int64_t max_seqlen = 0;         // max h*w
  int64_t max_window_seqlen = 0;  // max valid_h * valid_w * m^2 over windows
};
// window_side: ws = window_size / m / patch_size (merged tokens a window side), 0 for no windows.
MMFUSE_API int window_side(int spatial_merge_size, int window_size, int patch_size);
MMFUSE_API VisionGridSizes vision_grid_sizes(const TensorView& host_grid_thw, int spatial_merge_size, int ws);

// int64 elements of the CUDA workspace of vision_positions / window_index (per-grid prefix sums).
MMFUSE_API int64_t vision_workspace_size(int64_t grids);

// Patch positions and the angle table of the ViT's 2-D RoPE (HF rot_pos_emb): for patch n at (row,
// col): positions[n] = (row, col) (int64 [N, 2], optional) and angles[n] = [row * inv_freq | col *
// inv_freq] (fp32 [N, 2F], one fp32 multiply each; optional, needs inv_freq fp32 [F]). grid_thw on
// the device of the outputs (for CUDA: the device copy of the grid `sizes` were computed from).
MMFUSE_API void vision_positions(const TensorView& grid_thw, int spatial_merge_size, const VisionGridSizes& sizes,
                                 const TensorView& inv_freq, TensorView& positions, TensorView& angles,
                                 TensorView& workspace, cudaStream_t stream);

// Window order of the ViT's window attention (SEMANTICS.md section 4). Per grid (t, h, w), the merged
// grid h/m x w/m is tiled in ws x ws windows (the last row / column may be partial), listed frame by
// frame, window-row-major, merged tokens row-major inside a window. window_index [tokens] int64 lists
// merged-token indices (grids offset by their running token count) in that order; reverse_index
// [tokens] int64 (optional) is its inverse (a scatter); cu_window_seqlens [windows + 1] int32 is the
// running patch count of the windows from 0; cu_seqlens [frames + 1] int32 (optional) that of the
// frames (full-attention blocks).
MMFUSE_API void window_index(const TensorView& grid_thw, int spatial_merge_size, int ws, const VisionGridSizes& sizes,
                             TensorView& window_index, TensorView& reverse_index, TensorView& cu_window_seqlens,
                             TensorView& cu_seqlens, TensorView& workspace, cudaStream_t stream);

}  // namespace mmfuse
