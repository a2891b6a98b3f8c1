// Position-preprocessing entry points: validate the views, then call the backend.
#include "mmfuse/positions.h"

#include "common/dispatch.h"

namespace mmfuse {
namespace {

bool is_index(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

void check_index_view(const TensorView& v, const char* name, int ndim, Device dev) {
  const char* op = "rope_index";
  MMFUSE_CHECK(is_index(v.dtype), op, ": ", name, ": expected dtype int32 or int64, got ", dtype_name(v.dtype));
  MMFUSE_CHECK(v.ndim == ndim, op, ": ", name, ": expected ", ndim, "-D, got ", v.ndim, "-D ", shape_str(v));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected device ", device_name(dev), " (that of input_ids), got ",
               device_name(v.device));
}

}  // namespace

void rope_index(const TensorView& ids, const TensorView& mask, const TensorView& img, const TensorView& vid,
                const TensorView& sec, const RopeIndexParams& p, TensorView& pos, TensorView& deltas,
                cudaStream_t stream) {
  const char* op = "rope_index";
  MMFUSE_CHECK(ids.defined(), op, ": input_ids is missing");
  const Device dev = ids.device;
  check_index_view(ids, "input_ids", 2, dev);
  const int64_t B = ids.shape[0], L = ids.shape[1];
  if (mask.defined()) {
    check_index_view(mask, "attention_mask", 2, dev);
    MMFUSE_CHECK(mask.shape[0] == B && mask.shape[1] == L, op, ": attention_mask: expected shape [", B, ", ", L,
                 "] (that of input_ids), got ", shape_str(mask));
  }
  for (const auto& [g, name] : {std::pair{&img, "image_grid_thw"}, std::pair{&vid, "video_grid_thw"}}) {
    if (!g->defined()) continue;
    check_index_view(*g, name, 2, dev);
    MMFUSE_CHECK(g->shape[1] == 3, op, ": ", name, ": expected shape [n, 3] (t, h, w), got ", shape_str(*g));
  }
  if (sec.defined()) {
    MMFUSE_CHECK(vid.defined(), op, ": second_per_grid_ts given without video_grid_thw");
    MMFUSE_CHECK(sec.dtype == DType::kFloat32, op, ": second_per_grid_ts: expected dtype float32, got ",
                 dtype_name(sec.dtype));
    MMFUSE_CHECK(sec.ndim == 1 && sec.shape[0] == vid.shape[0], op, ": second_per_grid_ts: expected shape [",
                 vid.shape[0], "] (one per video), got ", shape_str(sec));
    MMFUSE_CHECK(sec.device == dev, op, ": second_per_grid_ts: expected device ", device_name(dev), ", got ",
                 device_name(sec.device));
  }
  MMFUSE_CHECK(p.spatial_merge_size >= 1, op, ": spatial_merge_size: expected >= 1, got ", p.spatial_merge_size);
  MMFUSE_CHECK(p.mode == RopeIndexMode::kQwen || p.mode == RopeIndexMode::kHf4, op, ": unknown mode ",
               int(p.mode));
  MMFUSE_CHECK(pos.dtype == DType::kInt64 && pos.ndim == 3 && pos.shape[0] == 3 && pos.shape[1] == B &&
                   pos.shape[2] == L,
               op, ": position_ids: expected int64 [3, ", B, ", ", L, "], got ", dtype_name(pos.dtype), " ",
               shape_str(pos));
  MMFUSE_CHECK(deltas.dtype == DType::kInt64 && deltas.ndim == 2 && deltas.shape[0] == B && deltas.shape[1] == 1,
               op, ": deltas: expected int64 [", B, ", 1], got ", dtype_name(deltas.dtype), " ", shape_str(deltas));
  MMFUSE_CHECK(pos.device == dev && deltas.device == dev, op, ": outputs: expected device ", device_name(dev));
  (void)stream;
  MMFUSE_CHECK(dev.type == DeviceType::kCPU, op, ": the CUDA backend of rope_index is not built yet; "
                                                 "pass CPU tensors (got ", device_name(dev), ")");
  detail::rope_index_cpu(ids, mask, img, vid, sec, p, pos, deltas);
}

namespace {

struct Grid {
  int64_t t, hm, wm;
};

int window_side(int m, int window_size, int patch_size) {
  const char* op = "window_index";
  MMFUSE_CHECK(m >= 1, op, ": spatial_merge_size: expected >= 1, got ", m);
  MMFUSE_CHECK(patch_size >= 1, op, ": patch_size: expected >= 1, got ", patch_size);
  const int ws = window_size / m / patch_size;
  MMFUSE_CHECK(ws >= 1, op, ": window_size / spatial_merge_size / patch_size: expected >= 1, got ", window_size, " / ",
               m, " / ", patch_size);
  return ws;
}

Grid grid_at(const TensorView& g, int64_t i, int m) {
  const int64_t t = index_at(g, i, 0), h = index_at(g, i, 1), w = index_at(g, i, 2);
  MMFUSE_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0, "window_index: grid_thw[", i, "] = (", t,
               ", ", h, ", ", w, "): expected positive t, h, w with h and w divisible by spatial_merge_size ", m);
  return {t, h / m, w / m};
}

void check_grid(const TensorView& g) {
  const char* op = "window_index";
  MMFUSE_CHECK(g.defined(), op, ": grid_thw is missing");
  MMFUSE_CHECK(is_index(g.dtype), op, ": grid_thw: expected dtype int32 or int64, got ", dtype_name(g.dtype));
  MMFUSE_CHECK(g.ndim == 2 && g.shape[1] == 3, op, ": grid_thw: expected shape [n, 3], got ", shape_str(g));
  MMFUSE_CHECK(g.device.type == DeviceType::kCPU, op,
               ": grid_thw: expected a CPU tensor (output sizes are computed on the host), got ",
               device_name(g.device));
}

}  // namespace

WindowIndexSizes window_index_sizes(const TensorView& g, int m, int window_size, int patch_size) {
  check_grid(g);
  const int ws = window_side(m, window_size, patch_size);
  WindowIndexSizes s{0, 0};
  for (int64_t i = 0; i < g.shape[0]; ++i) {
    const Grid q = grid_at(g, i, m);
    s.tokens += q.t * q.hm * q.wm;
    s.windows += q.t * ((q.hm + ws - 1) / ws) * ((q.wm + ws - 1) / ws);
  }
  return s;
}

void window_index(const TensorView& g, int m, int window_size, int patch_size, TensorView& idx, TensorView& cu,
                  cudaStream_t stream) {
  const char* op = "window_index";
  (void)stream;
  const WindowIndexSizes s = window_index_sizes(g, m, window_size, patch_size);
  const int ws = window_side(m, window_size, patch_size);
  MMFUSE_CHECK(idx.dtype == DType::kInt64 && idx.ndim == 1 && idx.shape[0] == s.tokens, op,
               ": window_index: expected int64 [", s.tokens, "], got ", dtype_name(idx.dtype), " ", shape_str(idx));
  MMFUSE_CHECK(cu.dtype == DType::kInt32 && cu.ndim == 1 && cu.shape[0] == s.windows + 1, op,
               ": cu_window_seqlens: expected int32 [", s.windows + 1, "], got ", dtype_name(cu.dtype), " ",
               shape_str(cu));
  MMFUSE_CHECK(idx.device.type == DeviceType::kCPU && cu.device.type == DeviceType::kCPU, op,
               ": the CUDA backend of window_index is not built yet; outputs must be CPU tensors");
  MMFUSE_CHECK(s.tokens * m * m < (int64_t(1) << 31), op, ": ", s.tokens * m * m,
               " patches overflow the int32 cu_window_seqlens");
  detail::window_index_cpu(g, m, ws, idx, cu);
}

}  // namespace mmfuse
