// Torch implementation of the position-preprocessing family (CPU for now; not differentiable).
#include <torch/library.h>

#include "mmfuse/positions.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

std::tuple<Tensor, Tensor> rope_index_impl(const Tensor& input_ids, const OptTensor& image_grid_thw,
                                           const OptTensor& video_grid_thw, const OptTensor& second_per_grid_ts,
                                           const OptTensor& attention_mask, int64_t spatial_merge_size,
                                           int64_t image_token_id, int64_t video_token_id,
                                           int64_t vision_start_token_id, double tokens_per_second,
                                           c10::string_view mode) {
  RopeIndexParams p;
  if (mode == "qwen") {
    p.mode = RopeIndexMode::kQwen;
  } else if (mode == "hf4") {
    p.mode = RopeIndexMode::kHf4;
  } else {
    TORCH_CHECK_VALUE(false, "mmfuse.rope_index: mode: expected \"qwen\" or \"hf4\", got \"", mode, "\"");
  }
  TORCH_CHECK_VALUE(spatial_merge_size >= 1 && spatial_merge_size < (1 << 16),
                    "mmfuse.rope_index: spatial_merge_size: expected a small positive integer, got ", spatial_merge_size);
  p.spatial_merge_size = int(spatial_merge_size);
  p.image_token_id = image_token_id;
  p.video_token_id = video_token_id;
  p.vision_start_token_id = vision_start_token_id;
  p.tokens_per_second = float(tokens_per_second);
  TORCH_CHECK_VALUE(input_ids.dim() == 2, "mmfuse.rope_index: input_ids: expected 2-D [B, L], got ", input_ids.sizes());
  const auto opts = input_ids.options().dtype(at::kLong);
  Tensor pos = at::empty({3, input_ids.size(0), input_ids.size(1)}, opts);
  Tensor deltas = at::empty({input_ids.size(0), 1}, opts);
  guarded("rope_index", [&] {
    TensorView pv = view(pos, "position_ids"), dv = view(deltas, "deltas");
    c10::OptionalDeviceGuard guard(input_ids.device());
    rope_index(view(input_ids, "input_ids"), view(attention_mask, "attention_mask"),
               view(image_grid_thw, "image_grid_thw"), view(video_grid_thw, "video_grid_thw"),
               view(second_per_grid_ts, "second_per_grid_ts"), p, pv, dv, current_stream(input_ids));
  });
  return {pos, deltas};
}

std::tuple<Tensor, Tensor> window_index_impl(const Tensor& grid_thw, int64_t spatial_merge_size, int64_t window_size,
                                             int64_t patch_size) {
  for (int64_t v : {spatial_merge_size, window_size, patch_size})
    TORCH_CHECK_VALUE(v >= 1 && v < (1 << 20), "mmfuse.window_index: spatial_merge_size, window_size and patch_size: "
                      "expected small positive integers, got ", spatial_merge_size, ", ", window_size, ", ", patch_size);
  const int m = int(spatial_merge_size), ws = int(window_size), ps = int(patch_size);
  Tensor idx, cu;
  guarded("window_index", [&] {
    const TensorView g = view(grid_thw, "grid_thw");
    const WindowIndexSizes s = window_index_sizes(g, m, ws, ps);
    idx = at::empty({s.tokens}, grid_thw.options().dtype(at::kLong));
    cu = at::empty({s.windows + 1}, grid_thw.options().dtype(at::kInt));
    TensorView iv = view(idx, "window_index"), cv = view(cu, "cu_window_seqlens");
    window_index(g, m, ws, ps, iv, cv, nullptr);
  });
  return {idx, cu};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) {
  m.impl("rope_index", &rope_index_impl);
  m.impl("window_index", &window_index_impl);
}

}  // namespace mmfuse::torch_bind
