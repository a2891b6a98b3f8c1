// Torch implementation of residual add + RMSNorm and its backward (CPU and CUDA through the core; the
// weight gradient's CUDA workspace from the caching allocator). Autograd: python/mmfuse/rms_norm.py.
#include <torch/library.h>

#include "mmfuse/rms_norm.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

RmsNormGrouping grouping(int64_t seq_len, int64_t split, bool x_grouped, bool out_grouped) {
  RmsNormGrouping g;
  g.seq_len = seq_len;
  g.split = split;
  g.x_grouped = x_grouped;
  g.out_grouped = out_grouped;
  return g;
}

at::ScalarType stat_type(const Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

int64_t rows_of(const Tensor& t) { return t.dim() == 2 ? t.size(0) : 0; }
int64_t cols_of(const Tensor& t) { return t.dim() == 2 ? t.size(1) : 0; }

std::tuple<Tensor, Tensor, Tensor> rms_norm_impl(const Tensor& x_in, const OptTensor& res_in, const Tensor& weight,
                                                 double eps, int64_t seq_len, int64_t split, bool x_grouped,
                                                 bool out_grouped) {
  const Tensor x = kernel_ready(x_in);
  const OptTensor res = res_in.has_value() ? OptTensor(kernel_ready(*res_in)) : std::nullopt;
  const int64_t T = rows_of(x), H = cols_of(x);
  const bool writes_h = res.has_value() || x_grouped;
  Tensor out = at::empty({T, H}, x.options());
  Tensor h = at::empty({writes_h ? T : 0, H}, x.options());
  Tensor rstd = at::empty({T}, x.options().dtype(stat_type(x)));
  guarded("rms_norm", [&] {
    TensorView ov = view(out, "out"), hv = writes_h ? view(h, "h_out") : TensorView{}, rv = view(rstd, "rstd");
    c10::OptionalDeviceGuard g(x.device());
    rms_norm(view(x, "x"), view(res, "residual"), view(weight, "weight"), eps,
             grouping(seq_len, split, x_grouped, out_grouped), ov, hv, rv, current_stream(x));
  });
  return {out, h, rstd};
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_backward_impl(const Tensor& dout_in, const OptTensor& dh_in,
                                                          const Tensor& h_in, const Tensor& rstd, const Tensor& weight,
                                                          int64_t seq_len, int64_t split, bool x_grouped,
                                                          bool out_grouped) {
  const Tensor dout = kernel_ready(dout_in), h = kernel_ready(h_in);  // h: the forward's x, as the caller had it
  const OptTensor dh = dh_in.has_value() ? OptTensor(kernel_ready(*dh_in)) : std::nullopt;
  const int64_t T = rows_of(h), H = cols_of(h);
  Tensor dx = at::empty({T, H}, h.options());
  Tensor dres = at::empty({x_grouped ? T : 0, H}, h.options());
  Tensor dweight = at::empty({H}, h.options().dtype(stat_type(h)));
  Tensor ws = at::empty({h.is_cuda() ? rms_norm_backward_workspace_size(T, H) : 0}, h.options().dtype(at::kFloat));
  guarded("rms_norm_backward", [&] {
    TensorView dxv = view(dx, "dx"), drv = x_grouped ? view(dres, "dresidual") : TensorView{};
    TensorView dwv = view(dweight, "dweight"), wsv = view(ws, "workspace");
    c10::OptionalDeviceGuard g(h.device());
    rms_norm_backward(view(dout, "dout"), view(dh, "dh"), view(h, "h"), view(rstd, "rstd"), view(weight, "weight"),
                      grouping(seq_len, split, x_grouped, out_grouped), dxv, drv, dwv, wsv, current_stream(h));
  });
  return {dx, dres, dweight};
}

void register_rms_norm(torch::Library& m) {
  m.impl("rms_norm", &rms_norm_impl);
  m.impl("rms_norm_backward", &rms_norm_backward_impl);
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) { register_rms_norm(m); }
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) { register_rms_norm(m); }

}  // namespace mmfuse::torch_bind
