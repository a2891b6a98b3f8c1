// Torch implementation of the dual-expert GEMM: the functional op and the in-place one (CUDA through
// the core, its workspace from the caching allocator; CPU checked by the core and computed with
// ATen's matmul), and autograd through a0, w0, a1, w1.
#include <torch/autograd.h>
#include <torch/library.h>

#include "mmfuse/dual_gemm.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [m, n] of op(a) @ op(w) (shapes are checked by the core; these only size the outputs)
std::vector<int64_t> out_shape(const Tensor& a, const Tensor& w, bool ta, bool tb) {
  if (a.dim() != 2 || w.dim() != 2) return {0, 0};
  return {ta ? a.size(1) : a.size(0), tb ? w.size(0) : w.size(1)};
}

DualGemmOptions options(bool trans_a, bool trans_b, bool accumulate) {
  DualGemmOptions opt;
  opt.trans_a = trans_a;
  opt.trans_b = trans_b;
  opt.accumulate = accumulate;
  return opt;
}

// One CPU product, out (+)= op(a) @ op(w), shapes checked: ATen's matmul (oneDNN / MKL), which
// accumulates bf16 and fp16 products in fp32 and rounds once, as the core's loop does, at the speed of
// torch.matmul. An fp32 output of bf16 / fp16 inputs multiplies fp32 copies (the products are exact
// in fp32 either way).
void gemm_aten(const Tensor& a, const Tensor& w, const Tensor& out, bool ta, bool tb, bool accumulate) {
  Tensor A = ta ? a.t() : a, W = tb ? w.t() : w;
  if (out.scalar_type() != a.scalar_type()) {
    A = A.to(out.scalar_type());
    W = W.to(out.scalar_type());
  }
  Tensor o = out;  // mm_out's out is a non-const reference; this is the same tensor
  if (accumulate)
    o.addmm_(A, W);
  else
    at::mm_out(o, A, W);
}

void dual_gemm_out_cpu(const Tensor& a0, const Tensor& w0, const Tensor& a1, const Tensor& w1, const Tensor& out0,
                       const Tensor& out1, bool trans_a, bool trans_b, bool accumulate) {
  guarded("dual_gemm", [&] {
    dual_gemm_check(view(a0, "a0"), view(w0, "w0"), view(out0, "out0"), view(a1, "a1"), view(w1, "w1"),
                    view(out1, "out1"), options(trans_a, trans_b, accumulate));
  });
  gemm_aten(a0, w0, out0, trans_a, trans_b, accumulate);
  gemm_aten(a1, w1, out1, trans_a, trans_b, accumulate);
}

void dual_gemm_out_impl(const Tensor& a0_in, const Tensor& w0_in, const Tensor& a1_in, const Tensor& w1_in,
                        const Tensor& out0, const Tensor& out1, bool trans_a, bool trans_b, bool accumulate) {
  // the operands as a caller has them (views of any strides): a dense copy where the kernels cannot read one
  const Tensor a0 = kernel_ready(a0_in), w0 = kernel_ready(w0_in), a1 = kernel_ready(a1_in), w1 = kernel_ready(w1_in);
  if (!a0.is_cuda()) return dual_gemm_out_cpu(a0, w0, a1, w1, out0, out1, trans_a, trans_b, accumulate);
  Tensor ws = at::empty({dual_gemm_workspace_bytes()}, a0.options().dtype(at::kByte));
  guarded("dual_gemm", [&] {
    TensorView o0 = view(out0, "out0"), o1 = view(out1, "out1"), wv = view(ws, "workspace");
    c10::OptionalDeviceGuard g(a0.device());
    dual_gemm(view(a0, "a0"), view(w0, "w0"), o0, view(a1, "a1"), view(w1, "w1"), o1,
              options(trans_a, trans_b, accumulate), wv, current_stream(a0));
  });
}

std::tuple<Tensor, Tensor> dual_gemm_impl(const Tensor& a0, const Tensor& w0, const Tensor& a1, const Tensor& w1,
                                          bool trans_a, bool trans_b, bool out_fp32) {
  const auto opts = a0.options().dtype(out_fp32 ? at::kFloat : a0.scalar_type());
  Tensor out0 = at::empty(out_shape(a0, w0, trans_a, trans_b), opts);
  Tensor out1 = at::empty(out_shape(a1, w1, trans_a, trans_b), opts);
  dual_gemm_out_impl(a0, w0, a1, w1, out0, out1, trans_a, trans_b, false);
  return {out0, out1};
}

std::tuple<Tensor, Tensor> call_dual_gemm(const Tensor& a0, const Tensor& w0, const Tensor& a1, const Tensor& w1,
                                          bool ta, bool tb, bool out_fp32 = false) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mmfuse::dual_gemm", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                               const Tensor&, bool, bool, bool)>();
  return op.call(a0, w0, a1, w1, ta, tb, out_fp32);
}

// With A = op(a), W = op(w), out = A @ W: dA = dout @ W^T and dW = A^T @ dout, written in terms of
// the stored a and w so that each backward product is one dual_gemm with shared flags.
struct DualGemmFn : public torch::autograd::Function<DualGemmFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& a0, const Tensor& w0, const Tensor& a1,
                               const Tensor& w1, bool ta, bool tb, bool out_fp32) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({a0, w0, a1, w1});
    ctx->saved_data["ta"] = ta;
    ctx->saved_data["tb"] = tb;
    auto [o0, o1] = call_dual_gemm(a0, w0, a1, w1, ta, tb, out_fp32);
    return {o0, o1};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool ta = ctx->saved_data["ta"].toBool(), tb = ctx->saved_data["tb"].toBool();
    const auto dtype = s[0].scalar_type();
    // an undefined output gradient is zero; gradients reach the products in the inputs' dtype
    auto g = [&](int e) {
      const Tensor& ref = e == 0 ? s[0] : s[2];
      const Tensor& w = e == 0 ? s[1] : s[3];
      if (!grads[e].defined()) return at::zeros(out_shape(ref, w, ta, tb), ref.options());
      return grads[e].to(dtype).contiguous();  // e.g. the expanded (stride-0) gradient of a sum()
    };
    const Tensor g0 = g(0), g1 = g(1);
    Tensor da0, da1, dw0, dw1;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(2)) {
      // da = dout @ W^T (trans_a: da = W @ dout^T)
      std::tie(da0, da1) = ta ? call_dual_gemm(s[1], g0, s[3], g1, tb, true)
                              : call_dual_gemm(g0, s[1], g1, s[3], false, !tb);
    }
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(3)) {
      // dw = A^T @ dout (trans_b: dw = dout^T @ A)
      std::tie(dw0, dw1) = tb ? call_dual_gemm(g0, s[0], g1, s[2], true, ta)
                              : call_dual_gemm(s[0], g0, s[2], g1, !ta, false);
    }
    auto keep = [&](int i, const Tensor& t) { return ctx->needs_input_grad(i) ? t : Tensor(); };
    return {keep(0, da0), keep(1, dw0), keep(2, da1), keep(3, dw1), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> dual_gemm_autograd(const Tensor& a0, const Tensor& w0, const Tensor& a1, const Tensor& w1,
                                              bool ta, bool tb, bool out_fp32) {
  auto r = DualGemmFn::apply(a0, w0, a1, w1, ta, tb, out_fp32);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) {
  m.impl("dual_gemm", &dual_gemm_impl);
  m.impl("dual_gemm_out", &dual_gemm_out_impl);
}
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) {
  m.impl("dual_gemm", &dual_gemm_impl);
  m.impl("dual_gemm_out", &dual_gemm_out_impl);
}
TORCH_LIBRARY_IMPL(mmfuse, Autograd, m) { m.impl("dual_gemm", &dual_gemm_autograd); }

}  // namespace mmfuse::torch_bind
