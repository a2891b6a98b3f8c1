// Torch implementation of the position-preprocessing family (CPU and CUDA; not differentiable).
// Vision ops: the output sizes come from a host copy of grid_thw (a device grid costs one copy to
// the host, the only synchronization of these ops); the kernels read the grid on the output device
// (a host grid is copied there without blocking).
#include <torch/library.h>

#include "mmfuse/positions.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

RopeIndexMode parse_mode(c10::string_view mode) {
  if (mode == "qwen") return RopeIndexMode::kQwen;
  if (mode == "hf4") return RopeIndexMode::kHf4;
  if (mode == "hf5") return RopeIndexMode::kHf5;
  TORCH_CHECK_VALUE(false, "mmfuse.rope_index: mode: expected \"qwen\", \"hf4\" or \"hf5\", got \"", mode, "\"");
}

int small_int(const char* op, const char* name, int64_t v) {
  TORCH_CHECK_VALUE(v >= 1 && v < (1 << 20), "mmfuse.", op, ": ", name, ": expected a positive integer below 2^20, got ",
                    v);
  return int(v);
}

std::tuple<Tensor, Tensor> rope_index_impl(const Tensor& input_ids, const OptTensor& image_grid_thw,
                                           const OptTensor& video_grid_thw, const OptTensor& second_per_grid_ts,
                                           const OptTensor& attention_mask, int64_t spatial_merge_size,
                                           int64_t image_token_id, int64_t video_token_id,
                                           int64_t vision_start_token_id, double tokens_per_second,
                                           c10::string_view mode, const OptTensor& mm_token_type_ids) {
  RopeIndexParams p;
  p.mode = parse_mode(mode);
  p.spatial_merge_size = small_int("rope_index", "spatial_merge_size", spatial_merge_size);
  p.image_token_id = image_token_id;
  p.video_token_id = video_token_id;
  p.vision_start_token_id = vision_start_token_id;
  p.tokens_per_second = float(tokens_per_second);
  TORCH_CHECK_VALUE(input_ids.dim() == 2, "mmfuse.rope_index: input_ids: expected 2-D [B, L], got ", input_ids.sizes());
  const int64_t B = input_ids.size(0), L = input_ids.size(1);
  const auto opts = input_ids.options().dtype(at::kLong);
  Tensor pos = at::empty({3, B, L}, opts);
  Tensor deltas = at::empty({B, 1}, opts);
  Tensor work = input_ids.is_cuda() ? at::empty({rope_index_workspace_size(B)}, opts.dtype(at::kInt)) : Tensor();
  guarded("rope_index", [&] {
    RopeIndexInputs in;
    in.input_ids = view(input_ids, "input_ids");
    in.attention_mask = view(attention_mask, "attention_mask");
    in.mm_token_type_ids = view(mm_token_type_ids, "mm_token_type_ids");
    in.image_grid_thw = view(image_grid_thw, "image_grid_thw");
    in.video_grid_thw = view(video_grid_thw, "video_grid_thw");
    in.second_per_grid_ts = view(second_per_grid_ts, "second_per_grid_ts");
    TensorView pv = view(pos, "position_ids"), dv = view(deltas, "deltas"), wv = view(work, "workspace");
    c10::OptionalDeviceGuard guard(input_ids.device());
    rope_index(in, p, pv, dv, wv, current_stream(input_ids));
  });
  return {pos, deltas};
}

// The grid on the host (for the sizes) and on the output device (for the kernels), and the sizes.
struct Grids {
  Tensor host, on_device;
  VisionGridSizes sizes;
};

Grids grids(const char* op, const Tensor& grid_thw, at::Device dev, int m, int ws) {
  Grids g;
  g.host = grid_thw.is_cpu() ? grid_thw : grid_thw.cpu();  // the one documented copy of a device grid
  guarded(op, [&] { g.sizes = vision_grid_sizes(view(g.host, "grid_thw"), m, ws); });
  g.on_device = grid_thw.device() == dev ? grid_thw : g.host.to(dev, /*non_blocking=*/true);
  return g;
}

Tensor workspace(const Grids& g, at::Device dev) {
  return dev.is_cuda() ? at::empty({vision_workspace_size(g.sizes.grids)}, at::TensorOptions(dev).dtype(at::kLong))
                       : Tensor();
}

Tensor vision_positions_impl(const Tensor& grid_thw, int64_t spatial_merge_size, std::optional<at::Device> device) {
  const int m = small_int("vision_positions", "spatial_merge_size", spatial_merge_size);
  const at::Device dev = device.value_or(grid_thw.device());
  const Grids g = grids("vision_positions", grid_thw, dev, m, 0);
  Tensor pos = at::empty({g.sizes.patches, 2}, at::TensorOptions(dev).dtype(at::kLong));
  Tensor work = workspace(g, dev);
  guarded("vision_positions", [&] {
    TensorView pv = view(pos, "positions"), av, wv = view(work, "workspace");
    c10::OptionalDeviceGuard guard(dev);
    vision_positions(view(g.on_device, "grid_thw"), m, g.sizes, TensorView{}, pv, av, wv, current_stream(pos));
  });
  return pos;
}

Tensor rot_pos_emb_impl(const Tensor& inv_freq, const Tensor& grid_thw, int64_t spatial_merge_size) {
  const int m = small_int("rot_pos_emb", "spatial_merge_size", spatial_merge_size);
  const at::Device dev = inv_freq.device();
  TORCH_CHECK_VALUE(inv_freq.dim() == 1, "mmfuse.rot_pos_emb: inv_freq: expected 1-D [F], got ", inv_freq.sizes());
  const Grids g = grids("rot_pos_emb", grid_thw, dev, m, 0);
  Tensor ang = at::empty({g.sizes.patches, 2 * inv_freq.size(0)}, inv_freq.options().dtype(at::kFloat));
  Tensor work = workspace(g, dev);
  guarded("rot_pos_emb", [&] {
    TensorView pv, av = view(ang, "angles"), wv = view(work, "workspace");
    c10::OptionalDeviceGuard guard(dev);
    vision_positions(view(g.on_device, "grid_thw"), m, g.sizes, view(inv_freq, "inv_freq"), pv, av, wv,
                     current_stream(ang));
  });
  return ang;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> window_index_impl(const Tensor& grid_thw, int64_t spatial_merge_size,
                                                             int64_t window_size, int64_t patch_size,
                                                             std::optional<at::Device> device) {
  const int m = small_int("window_index", "spatial_merge_size", spatial_merge_size);
  const int wsz = small_int("window_index", "window_size", window_size);
  const int ps = small_int("window_index", "patch_size", patch_size);
  int ws = 0;
  guarded("window_index", [&] { ws = window_side(m, wsz, ps); });
  const at::Device dev = device.value_or(grid_thw.device());
  const Grids g = grids("window_index", grid_thw, dev, m, ws);
  const auto l = at::TensorOptions(dev).dtype(at::kLong), i = at::TensorOptions(dev).dtype(at::kInt);
  Tensor idx = at::empty({g.sizes.tokens}, l), rev = at::empty({g.sizes.tokens}, l);
  Tensor cu = at::empty({g.sizes.windows + 1}, i), cus = at::empty({g.sizes.frames + 1}, i);
  Tensor work = workspace(g, dev);
  guarded("window_index", [&] {
    TensorView iv = view(idx, "window_index"), rv = view(rev, "reverse_index"), cv = view(cu, "cu_window_seqlens"),
               sv = view(cus, "cu_seqlens"), wv = view(work, "workspace");
    c10::OptionalDeviceGuard guard(dev);
    window_index(view(g.on_device, "grid_thw"), m, ws, g.sizes, iv, rv, cv, sv, wv, current_stream(idx));
  });
  return {idx, cu, rev, cus};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) {
  m.impl("rope_index", &rope_index_impl);
  m.impl("vision_positions", &vision_positions_impl);
  m.impl("rot_pos_emb", &rot_pos_emb_impl);
  m.impl("window_index", &window_index_impl);
}

TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) {  // the core reports a build without CUDA
  m.impl("rope_index", &rope_index_impl);
  m.impl("vision_positions", &vision_positions_impl);
  m.impl("rot_pos_emb", &rot_pos_emb_impl);
  m.impl("window_index", &window_index_impl);
}

}  // namespace mmfuse::torch_bind
