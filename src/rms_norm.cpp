// Residual add + RMSNorm entry points: validate the views, then call the CPU or CUDA backend.
#include "backends/rms_norm.h"
#include "mmfuse/rms_norm.h"

#include <cmath>
#include <string>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {
namespace {

void check_grouping(const char* op, const RmsNormGrouping& g, int64_t T) {
  MMFUSE_CHECK(g.seq_len >= 0, op, ": seq_len: expected >= 0, got ", g.seq_len);
  if (g.seq_len == 0) {
    MMFUSE_CHECK(!g.x_grouped && !g.out_grouped, op, ": x_grouped / out_grouped need a grouping (seq_len > 0)");
    return;
  }
  MMFUSE_CHECK(T % g.seq_len == 0, op, ": seq_len: expected a divisor of the ", T, " tokens, got ", g.seq_len);
  MMFUSE_CHECK(g.split >= 0 && g.split <= g.seq_len, op, ": split: expected in [0, seq_len = ", g.seq_len, "], got ",
               g.split);
}

DType stat_dtype(DType dt) { return dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

}  // namespace

void rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
              const RmsNormGrouping& g, TensorView& out, TensorView& h_out, TensorView& rstd, cudaStream_t stream) {
  const char* op = "rms_norm";
  MMFUSE_CHECK(x.defined() && x.ndim == 2, op, ": x: expected a 2-D tensor [T, H], got ",
               x.defined() ? shape_str(x) : std::string("none"));
  const int64_t T = x.shape[0], H = x.shape[1];
  const DType dt = x.dtype;
  const Device dev = x.device;
  dispatch_floating(dt, "rms_norm: x", [](auto) {});
  MMFUSE_CHECK(dev.type == DeviceType::kCPU || dt != DType::kFloat64, op, ": x: float64 is CPU only");
  MMFUSE_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps: expected a finite value >= 0, got ", eps);
  check_matrix(op, x, "x", T, H, dt, dev);
  check_vector(op, weight, "weight", H, dt, dev);
  check_grouping(op, g, T);
  check_matrix(op, out, "out", T, H, dt, dev);
  check_vector(op, rstd, "rstd", T, stat_dtype(dt), dev);
  const bool writes_h = residual.defined() || g.x_grouped;
  if (residual.defined()) check_matrix(op, residual, "residual", T, H, dt, dev);
  if (writes_h) check_matrix(op, h_out, "h_out", T, H, dt, dev);
  check_outputs_separate(op, {{&out, "out"}, {writes_h ? &h_out : nullptr, "h_out"}, {&rstd, "rstd"}},
                         {{&x, "x"}, {&residual, "residual"}, {&weight, "weight"}});
  if (T == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::rms_norm_cpu(x, residual, weight, eps, g, out, h_out, rstd);
  MMFUSE_CUDA_BACKEND(op, stream, detail::rms_norm_cuda(x, residual, weight, eps, g, out, h_out, rstd, stream));
}

int64_t rms_norm_backward_workspace_size(int64_t tokens, int64_t hidden) {
  // per-block partial sums of the weight gradient: at most kMaxBlocks blocks (src/cuda/rms_norm.cu)
  constexpr int64_t kMaxBlocks = 1024;
  return std::max<int64_t>(1, std::min<int64_t>(tokens, kMaxBlocks) * hidden);
}

void rms_norm_backward(const TensorView& dout, const TensorView& dh, const TensorView& h, const TensorView& rstd,
                       const TensorView& weight, const RmsNormGrouping& g, TensorView& dx, TensorView& dres,
                       TensorView& dweight, TensorView& workspace, cudaStream_t stream) {
  const char* op = "rms_norm_backward";
  MMFUSE_CHECK(h.defined() && h.ndim == 2, op, ": h: expected a 2-D tensor [T, H], got ",
               h.defined() ? shape_str(h) : std::string("none"));
  const int64_t T = h.shape[0], H = h.shape[1];
  const DType dt = h.dtype;
  const Device dev = h.device;
  dispatch_floating(dt, "rms_norm_backward: h", [](auto) {});
  check_matrix(op, h, "h", T, H, dt, dev);
  check_matrix(op, dout, "dout", T, H, dt, dev);
  if (dh.defined()) check_matrix(op, dh, "dh", T, H, dt, dev);
  check_vector(op, rstd, "rstd", T, stat_dtype(dt), dev);
  check_vector(op, weight, "weight", H, dt, dev);
  check_grouping(op, g, T);
  check_matrix(op, dx, "dx", T, H, dt, dev);
  if (g.x_grouped) check_matrix(op, dres, "dresidual", T, H, dt, dev);
  check_vector(op, dweight, "dweight", H, stat_dtype(dt), dev);
  check_outputs_separate(op, {{&dx, "dx"}, {g.x_grouped ? &dres : nullptr, "dresidual"}, {&dweight, "dweight"}},
                         {{&dout, "dout"}, {&dh, "dh"}, {&h, "h"}, {&rstd, "rstd"}, {&weight, "weight"}});
  if (dev.type == DeviceType::kCPU) return detail::rms_norm_backward_cpu(dout, dh, h, rstd, weight, g, dx, dres, dweight);
  check_workspace(op, workspace, dev, rms_norm_backward_workspace_size(T, H) * 4);
  MMFUSE_CUDA_BACKEND(op, stream,
                      detail::rms_norm_backward_cuda(dout, dh, h, rstd, weight, g, dx, dres, dweight, workspace,
                                                     stream));
}

}  // namespace mmfuse
