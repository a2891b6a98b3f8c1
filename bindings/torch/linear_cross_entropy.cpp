// Torch implementation of linear_cross_entropy's logits gradient (CPU and CUDA through the core); the
// op around it: python/mmfuse/linear_cross_entropy.py.
#include <torch/library.h>

#include "mmfuse/linear_cross_entropy.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;

std::tuple<Tensor, Tensor> logits_grad_impl(const Tensor& z_in, const Tensor& labels_in, const Tensor& row_scale_in,
                                            int64_t ignore_index, double label_smoothing, double z_loss,
                                            double softcap, at::ScalarType g_dtype, bool want_grad) {
  const Tensor z = kernel_ready(z_in), labels = kernel_ready(labels_in), row_scale = kernel_ready(row_scale_in);
  const int64_t C = z.dim() == 2 ? z.size(0) : 0, V = z.dim() == 2 ? z.size(1) : 0;
  Tensor loss = at::empty({C}, z.options().dtype(at::kFloat));
  Tensor g = at::empty({want_grad ? C : 0, V}, z.options().dtype(g_dtype));
  guarded("linear_cross_entropy_logits_grad", [&] {
    TensorView lv = view(loss, "loss"), gv = want_grad ? view(g, "g") : TensorView{};
    c10::OptionalDeviceGuard guard(z.device());
    linear_cross_entropy_logits_grad(view(z, "z"), view(labels, "labels"), view(row_scale, "row_scale"), ignore_index,
                                     float(label_smoothing), float(z_loss), float(softcap), lv, gv, current_stream(z));
  });
  return {loss, g};
}

Tensor logits_grad_out_impl(const Tensor& z_in, const Tensor& labels_in, const Tensor& row_scale_in,
                            int64_t ignore_index, double label_smoothing, double z_loss, double softcap, Tensor& g) {
  const Tensor z = kernel_ready(z_in), labels = kernel_ready(labels_in), row_scale = kernel_ready(row_scale_in);
  Tensor loss = at::empty({z.dim() == 2 ? z.size(0) : 0}, z.options().dtype(at::kFloat));
  guarded("linear_cross_entropy_logits_grad_out", [&] {
    TensorView lv = view(loss, "loss"), gv = view(g, "g");
    c10::OptionalDeviceGuard guard(z.device());
    linear_cross_entropy_logits_grad(view(z, "z"), view(labels, "labels"), view(row_scale, "row_scale"), ignore_index,
                                     float(label_smoothing), float(z_loss), float(softcap), lv, gv, current_stream(z));
  });
  return loss;
}

void register_linear_cross_entropy(torch::Library& m) {
  m.impl("linear_cross_entropy_logits_grad", &logits_grad_impl);
  m.impl("linear_cross_entropy_logits_grad_out", &logits_grad_out_impl);
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) { register_linear_cross_entropy(m); }
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) { register_linear_cross_entropy(m); }

}  // namespace mmfuse::torch_bind
