// Position-preprocessing entry points: validate the views, then call the backend.
#include "mmfuse/positions.h"

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

}  // namespace mmfuse
