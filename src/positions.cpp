// Position-preprocessing entry points: validate the views, then call the CPU or CUDA backend.
#include "backends/positions.h"
#include "mmfuse/positions.h"

#include <algorithm>

#include "common/dispatch.h"

namespace mmfuse {
namespace {

bool is_index(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

void check_index_view(const char* op, const TensorView& v, const char* name, int ndim, Device dev) {
  MMFUSE_CHECK(is_index(v.dtype), op, ": ", name, ": expected dtype int32 or int64, got ", dtype_name(v.dtype));
  MMFUSE_CHECK(v.ndim == ndim, op, ": ", name, ": expected ", ndim, "-D, got ", v.ndim, "-D ", shape_str(v));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected device ", device_name(dev), ", got ",
               device_name(v.device));
}

void check_output(const char* op, const TensorView& v, const char* name, DType dt, int ndim, const int64_t* shape,
                  Device dev) {
  bool ok = v.dtype == dt && v.ndim == ndim && v.device == dev;
  for (int i = 0; ok && i < ndim; ++i) ok = v.shape[i] == shape[i];
  std::string want = "[";
  for (int i = 0; i < ndim; ++i) want += detail::cat(i ? ", " : "", shape[i]);
  want += "]";
  MMFUSE_CHECK(ok, op, ": ", name, ": expected ", dtype_name(dt), " ", want, " on ", device_name(dev), ", got ",
               dtype_name(v.dtype), " ", shape_str(v), " on ", device_name(v.device));
}

}  // namespace

int64_t rope_index_workspace_size(int64_t batch) { return 2 * batch; }

void rope_index(const RopeIndexInputs& in, const RopeIndexParams& p, TensorView& pos, TensorView& deltas,
                TensorView& ws, cudaStream_t stream) {
  const char* op = "rope_index";
  const TensorView& ids = in.input_ids;
  MMFUSE_CHECK(ids.defined(), op, ": input_ids is missing");
  const Device dev = ids.device;
  check_index_view(op, ids, "input_ids", 2, dev);
  const int64_t B = ids.shape[0], L = ids.shape[1];
  for (const auto& [v, name] : {std::pair{&in.attention_mask, "attention_mask"},
                                std::pair{&in.mm_token_type_ids, "mm_token_type_ids"}}) {
    if (!v->defined()) continue;
    check_index_view(op, *v, name, 2, dev);
    MMFUSE_CHECK(v->shape[0] == B && v->shape[1] == L, op, ": ", name, ": expected shape [", B, ", ", L,
                 "] (that of input_ids), got ", shape_str(*v));
  }
  const bool hf5 = p.mode == RopeIndexMode::kHf5;
  MMFUSE_CHECK(p.mode == RopeIndexMode::kQwen || p.mode == RopeIndexMode::kHf4 || hf5, op, ": unknown mode ",
               int(p.mode));
  MMFUSE_CHECK(!hf5 || in.mm_token_type_ids.defined(), op,
               ": mode hf5 needs mm_token_type_ids (0 text, 1 image, 2 video), got none");
  for (const auto& [g, name] : {std::pair{&in.image_grid_thw, "image_grid_thw"},
                                std::pair{&in.video_grid_thw, "video_grid_thw"}}) {
    if (!g->defined()) continue;
    check_index_view(op, *g, name, 2, dev);
    MMFUSE_CHECK(g->shape[1] == 3, op, ": ", name, ": expected shape [n, 3] (t, h, w), got ", shape_str(*g));
    MMFUSE_CHECK(g->shape[0] < (int64_t(1) << 31), op, ": ", name, ": more than 2^31 grids");
  }
  const TensorView& sec = in.second_per_grid_ts;
  if (sec.defined()) {
    MMFUSE_CHECK(in.video_grid_thw.defined(), op, ": second_per_grid_ts given without video_grid_thw");
    MMFUSE_CHECK(sec.dtype == DType::kFloat32, op, ": second_per_grid_ts: expected dtype float32, got ",
                 dtype_name(sec.dtype));
    MMFUSE_CHECK(sec.ndim == 1 && sec.shape[0] == in.video_grid_thw.shape[0], op,
                 ": second_per_grid_ts: expected shape [", in.video_grid_thw.shape[0], "] (one per video), got ",
                 shape_str(sec));
    MMFUSE_CHECK(sec.device == dev, op, ": second_per_grid_ts: expected device ", device_name(dev), ", got ",
                 device_name(sec.device));
  }
  MMFUSE_CHECK(p.spatial_merge_size >= 1 && p.spatial_merge_size < (1 << 16), op,
               ": spatial_merge_size: expected a positive integer below 65536, got ", p.spatial_merge_size);
  MMFUSE_CHECK(L < (int64_t(1) << 31), op, ": input_ids: rows longer than 2^31 tokens are not supported, got ", L);
  const int64_t ps[3] = {3, B, L}, ds[2] = {B, 1};
  check_output(op, pos, "position_ids", DType::kInt64, 3, ps, dev);
  check_output(op, deltas, "deltas", DType::kInt64, 2, ds, dev);
  if (dev.type == DeviceType::kCPU) return detail::rope_index_cpu(in, p, pos, deltas);
  const int64_t wss[1] = {rope_index_workspace_size(B)};
  check_output(op, ws, "workspace", DType::kInt32, 1, wss, dev);
  MMFUSE_CUDA_BACKEND(op, stream, detail::rope_index_cuda(in, p, pos, deltas, ws, stream));
}

// ---- vision -------------------------------------------------------------------------------------

int window_side(int m, int window_size, int patch_size) {
  const char* op = "window_index";
  MMFUSE_CHECK(m >= 1 && m < (1 << 16), op, ": spatial_merge_size: expected a positive integer, got ", m);
  MMFUSE_CHECK(patch_size >= 1, op, ": patch_size: expected >= 1, got ", patch_size);
  const int ws = window_size / m / patch_size;
  MMFUSE_CHECK(ws >= 1, op, ": window_size / spatial_merge_size / patch_size: expected >= 1, got ", window_size,
               " / ", m, " / ", patch_size);
  return ws;
}

namespace {

void check_grid(const char* op, const TensorView& g) {
  MMFUSE_CHECK(g.defined(), op, ": grid_thw is missing");
  MMFUSE_CHECK(is_index(g.dtype), op, ": grid_thw: expected dtype int32 or int64, got ", dtype_name(g.dtype));
  MMFUSE_CHECK(g.ndim == 2 && g.shape[1] == 3, op, ": grid_thw: expected shape [n, 3], got ", shape_str(g));
}

}  // namespace

VisionGridSizes vision_grid_sizes(const TensorView& g, int m, int ws) {
  const char* op = "vision_grid_sizes";
  check_grid(op, g);
  MMFUSE_CHECK(g.device.type == DeviceType::kCPU, op,
               ": grid_thw: expected a host tensor (output sizes are computed on the host), got ",
               device_name(g.device));
  MMFUSE_CHECK(m >= 1 && m < (1 << 16), op, ": spatial_merge_size: expected a positive integer, got ", m);
  VisionGridSizes s;
  s.grids = g.shape[0];
  for (int64_t i = 0; i < g.shape[0]; ++i) {
    const int64_t t = index_at(g, i, 0), h = index_at(g, i, 1), w = index_at(g, i, 2);
    MMFUSE_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0 && t < (1 << 20) && h < (1 << 20) &&
                     w < (1 << 20),
                 "grid_thw[", i, "] = (", t, ", ", h, ", ", w,
                 "): expected positive t, h, w below 2^20 with h and w divisible by spatial_merge_size ", m);
    const int64_t hm = h / m, wm = w / m;
    s.frames += t;
    s.patches += t * h * w;
    s.tokens += t * hm * wm;
    s.max_seqlen = std::max(s.max_seqlen, h * w);
    if (ws > 0) {
      s.windows += t * ((hm + ws - 1) / ws) * ((wm + ws - 1) / ws);
      s.max_window_seqlen = std::max(s.max_window_seqlen, std::min<int64_t>(ws, hm) * std::min<int64_t>(ws, wm) * m * m);
    }
  }
  MMFUSE_CHECK(s.patches < (int64_t(1) << 31), op, ": ", s.patches, " patches overflow the int32 cu_seqlens");
  return s;
}

int64_t vision_workspace_size(int64_t grids) { return 4 * (grids + 1); }

namespace {

// The checks vision_positions and window_index share: the grid's shape and device, the workspace.
void check_vision_common(const char* op, const TensorView& g, int m, int wside, const VisionGridSizes& s, Device dev,
                         TensorView& ws) {
  check_grid(op, g);
  if (g.device.type == DeviceType::kCPU) {  // the CPU backends trust the sizes: recompute them
    const VisionGridSizes c = vision_grid_sizes(g, m, wside);
    MMFUSE_CHECK(c.patches == s.patches && c.tokens == s.tokens && c.frames == s.frames &&
                     (wside == 0 || c.windows == s.windows),
                 op, ": sizes: not those of grid_thw (compute them with vision_grid_sizes on the same grid)");
  }
  MMFUSE_CHECK(g.shape[0] == s.grids, op, ": grid_thw: expected the ", s.grids, " grids the sizes were computed from, got ",
               g.shape[0]);
  MMFUSE_CHECK(g.device == dev, op, ": grid_thw: expected device ", device_name(dev), " (that of the outputs), got ",
               device_name(g.device));
  if (dev.type == DeviceType::kCUDA) {
    const int64_t wss[1] = {vision_workspace_size(s.grids)};
    check_output(op, ws, "workspace", DType::kInt64, 1, wss, dev);
  }
}

}  // namespace

void vision_positions(const TensorView& g, int m, const VisionGridSizes& s, const TensorView& inv_freq,
                      TensorView& positions, TensorView& angles, TensorView& ws, cudaStream_t stream) {
  const char* op = "vision_positions";
  MMFUSE_CHECK(positions.defined() || angles.defined(), op, ": nothing to compute (no positions, no angles)");
  const Device dev = positions.defined() ? positions.device : angles.device;
  check_vision_common(op, g, m, 0, s, dev, ws);
  if (positions.defined()) {
    const int64_t ps[2] = {s.patches, 2};
    check_output(op, positions, "positions", DType::kInt64, 2, ps, dev);
  }
  if (angles.defined()) {
    MMFUSE_CHECK(inv_freq.defined(), op, ": angles need inv_freq");
    MMFUSE_CHECK(inv_freq.dtype == DType::kFloat32 && inv_freq.ndim == 1 && inv_freq.device == dev, op,
                 ": inv_freq: expected float32 [F] on ", device_name(dev), ", got ", dtype_name(inv_freq.dtype), " ",
                 shape_str(inv_freq), " on ", device_name(inv_freq.device));
    const int64_t as[2] = {s.patches, 2 * inv_freq.shape[0]};
    check_output(op, angles, "angles", DType::kFloat32, 2, as, dev);
  }
  if (dev.type == DeviceType::kCPU) return detail::vision_positions_cpu(g, m, inv_freq, positions, angles);
  MMFUSE_CUDA_BACKEND(op, stream, detail::vision_positions_cuda(g, m, s, inv_freq, positions, angles, ws, stream));
}

void window_index(const TensorView& g, int m, int wside, const VisionGridSizes& s, TensorView& idx, TensorView& rev,
                  TensorView& cu, TensorView& cus, TensorView& ws, cudaStream_t stream) {
  const char* op = "window_index";
  MMFUSE_CHECK(wside >= 1, op, ": window side: expected >= 1 merged tokens, got ", wside);
  const Device dev = idx.device;
  check_vision_common(op, g, m, wside, s, dev, ws);
  const int64_t ts[1] = {s.tokens}, wsz[1] = {s.windows + 1}, fs[1] = {s.frames + 1};
  check_output(op, idx, "window_index", DType::kInt64, 1, ts, dev);
  if (rev.defined()) check_output(op, rev, "reverse_index", DType::kInt64, 1, ts, dev);
  check_output(op, cu, "cu_window_seqlens", DType::kInt32, 1, wsz, dev);
  if (cus.defined()) check_output(op, cus, "cu_seqlens", DType::kInt32, 1, fs, dev);
  if (dev.type == DeviceType::kCPU) return detail::window_index_cpu(g, m, wside, idx, rev, cu, cus);
  MMFUSE_CUDA_BACKEND(op, stream, detail::window_index_cuda(g, m, wside, s, idx, rev, cu, cus, ws, stream));
}

}  // namespace mmfuse
