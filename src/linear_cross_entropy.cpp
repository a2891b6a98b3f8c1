// linear_cross_entropy entry points: validate the views, then call the CPU or CUDA backend.
#include "backends/linear_cross_entropy.h"
#include "mmfuse/linear_cross_entropy.h"

#include <cmath>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {

void linear_cross_entropy_logits_grad(const TensorView& z, const TensorView& labels, const TensorView& row_scale,
                                      int64_t ignore_index, float label_smoothing, float z_loss, float softcap,
                                      TensorView& loss, TensorView& g, cudaStream_t stream) {
  const char* op = "linear_cross_entropy_logits_grad";
  MMFUSE_CHECK(z.defined() && z.ndim == 2, op, ": z: expected a 2-D tensor [C, V], got ",
               z.defined() ? shape_str(z) : std::string("none"));
  const int64_t C = z.shape[0], V = z.shape[1];
  const Device dev = z.device;
  MMFUSE_CHECK(z.dtype == DType::kFloat32 || z.dtype == DType::kBFloat16 || z.dtype == DType::kFloat16, op,
               ": z: expected dtype float32, bfloat16 or float16, got ", dtype_name(z.dtype));
  check_matrix(op, z, "z", C, V, z.dtype, dev);
  check_vector(op, labels, "labels", C, DType::kInt64, dev);
  check_vector(op, row_scale, "row_scale", C, DType::kFloat32, dev);
  check_vector(op, loss, "loss", C, DType::kFloat32, dev);
  if (g.defined()) {
    MMFUSE_CHECK(g.dtype == DType::kBFloat16 || g.dtype == DType::kFloat16 || g.dtype == DType::kFloat32, op,
                 ": g: expected dtype bfloat16, float16 or float32, got ", dtype_name(g.dtype));
    check_matrix(op, g, "g", C, V, g.dtype, dev, "z");
    MMFUSE_CHECK(z.dtype == DType::kFloat32 || g.dtype == z.dtype, op, ": g: expected dtype ", dtype_name(z.dtype),
                 " (that of z; any with float32 z), got ", dtype_name(g.dtype));
  }
  MMFUSE_CHECK(label_smoothing >= 0.0f && label_smoothing < 1.0f && z_loss >= 0.0f && softcap >= 0.0f &&
                   std::isfinite(z_loss) && std::isfinite(softcap),
               op, ": expected 0 <= label_smoothing < 1, finite z_loss >= 0 and softcap >= 0, got ", label_smoothing,
               ", ", z_loss, ", ", softcap);
  MMFUSE_CHECK(C == 0 || V > 0, op, ": z: expected at least one class, got shape ", shape_str(z));
  check_outputs_separate(op, {{&loss, "loss"}, {g.defined() ? &g : nullptr, "g"}},
                         {{&z, "z"}, {&labels, "labels"}, {&row_scale, "row_scale"}});
  if (C == 0) return;
  const detail::LceParams p{ignore_index, label_smoothing, z_loss, softcap};
  if (dev.type == DeviceType::kCPU) return detail::linear_cross_entropy_logits_grad_cpu(z, labels, row_scale, p, loss, g);
  MMFUSE_CUDA_BACKEND(op, stream,
                      detail::linear_cross_entropy_logits_grad_cuda(z, labels, row_scale, p, loss, g, stream));
}

}  // namespace mmfuse
