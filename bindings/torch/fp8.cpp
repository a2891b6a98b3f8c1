// Torch implementation of the fp8 family (CPU and CUDA): the quantize pass, the fp8 GEMM (new or
// in-place output), and the linear layer's forward and backward pipelines (several core calls each:
// one quantize launch for x and w together, one GEMM; the backward quantizes the gradient once for
// both GEMMs). Autograd lives in python/mmfuse/fp8.py, where the module's scale state and weight
// cache decide what each call quantizes.
#include <torch/library.h>

#include "mmfuse/fp8.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

at::ScalarType fp8_type(bool e5m2) { return e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn; }

Tensor empty0(const Tensor& like) { return at::empty({0}, like.options()); }

// The quantized outputs of one tensor: scale_inv of q, scale_inv_t of qt (per row only; per tensor
// qt shares scale_inv and scale_inv_t is empty); scratch: the per-row maxima.
struct Quantized {
  Tensor q, qt, scale_inv, scale_inv_t, scratch;
  const Tensor& qt_scale_inv() const { return scale_inv_t.numel() ? scale_inv_t : scale_inv; }
};

// Fills a core job for x [R, C] (swiglu: the source [R, 2C] of swiglu(x) [R, C]) with the outputs it
// asks for (allocated here).
// The pack of a swiglu_grad source (swiglu_pack_fp8's q and scale_inv), kernel-ready; undefined when
// the op's swiglu_q / swiglu_scale_inv were not given (both or neither: checked).
struct SwigluPack {
  Tensor q, scale_inv;
  bool given() const { return q.defined(); }
};

SwigluPack swiglu_pack_arg(const char* op, const OptTensor& q, const OptTensor& scale_inv) {
  TORCH_CHECK_VALUE(q.has_value() == scale_inv.has_value(), "mmfuse.", op, ": swiglu_q and swiglu_scale_inv: "
                    "expected both or neither, got ", q ? "swiglu_q only" : "swiglu_scale_inv only");
  if (!q) return {};
  return {kernel_ready(*q), kernel_ready(*scale_inv)};
}

// pack given (swiglu_grad): x is dy [R, C] and the tensor the [gate | up] gradient [R, 2C] from it.
Fp8QuantJob make_job(const Tensor& x, Tensor& state, bool rowwise, bool transposed, bool e5m2, bool dynamic,
                     bool per_row, Quantized& out, bool swiglu = false, const SwigluPack& pack = {}) {
  const int64_t sc = x.dim() == 2 ? x.size(1) : 0;
  const int64_t r = x.dim() == 2 ? x.size(0) : 0, c = swiglu ? sc / 2 : pack.given() ? 2 * sc : sc;
  const int64_t rp = fp8_padded(r), cp = fp8_padded(c);
  const auto opts = x.options().dtype(fp8_type(e5m2));
  const auto f32 = x.options().dtype(at::kFloat);
  out.q = at::empty(rowwise ? at::IntArrayRef{rp, cp} : at::IntArrayRef{0}, opts);
  out.qt = at::empty(transposed ? at::IntArrayRef{cp, rp} : at::IntArrayRef{0}, opts);
  out.scale_inv = at::empty({per_row ? rp : 1}, f32);
  out.scale_inv_t = at::empty({per_row && transposed ? cp : 0}, f32);
  Fp8QuantJob j;
  j.src = view(x, "x");
  if (rowwise) j.q = view(out.q, "q");
  if (transposed) j.qt = view(out.qt, "qt");
  j.scale_inv = view(out.scale_inv, "scale_inv");
  j.dynamic = dynamic;
  j.per_row = per_row;
  j.swiglu = swiglu;
  if (pack.given()) {
    j.swiglu_grad = true;
    j.pack_q = view(pack.q, "swiglu_q");
    j.pack_scale_inv = view(pack.scale_inv, "swiglu_scale_inv");
  }
  if (per_row) {
    out.scratch = at::zeros({rp + cp}, f32);
    j.scratch = view(out.scratch, "scratch");
    if (transposed) j.scale_inv_t = view(out.scale_inv_t, "scale_inv_t");
  } else {
    j.state = view(state, "state");
  }
  return j;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_quantize_impl(const Tensor& x_in, Tensor& state, bool rowwise,
                                                             bool transposed, bool e5m2, bool dynamic, bool per_row,
                                                             const OptTensor& swiglu_q,
                                                             const OptTensor& swiglu_scale_inv) {
  const Tensor x = kernel_ready(x_in);
  const SwigluPack pack = swiglu_pack_arg("fp8_quantize", swiglu_q, swiglu_scale_inv);
  Quantized out;
  guarded("fp8_quantize", [&] {
    Fp8QuantJob j = make_job(x, state, rowwise, transposed, e5m2, dynamic, per_row, out, false, pack);
    c10::OptionalDeviceGuard g(x.device());
    fp8_quantize(&j, 1, current_stream(x));
  });
  return {out.q, out.qt, out.scale_inv, out.scale_inv_t};
}

Tensor fp8_transpose_impl(const Tensor& q_in) {
  const Tensor q = q_in.contiguous();  // any view (a slice of a padded copy): the kernel reads dense rows
  Tensor qt = at::empty(q.dim() == 2 ? at::IntArrayRef{q.size(1), q.size(0)} : at::IntArrayRef{0}, q.options());
  guarded("fp8_transpose", [&] {
    TensorView out = view(qt, "qt");
    c10::OptionalDeviceGuard g(q.device());
    fp8_transpose(view(q, "q"), out, current_stream(q));
  });
  return qt;
}

Tensor gemm_workspace(const Tensor& t) {
  return at::empty({t.is_cuda() ? fp8_gemm_workspace_bytes() : 0}, t.options().dtype(at::kByte));
}

// out (+)= (a @ b^T) * scale_a * scale_b (+ bias), into a given [M, N] view.
void gemm_into(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
               const OptTensor& bias, const Tensor& out, bool accumulate, bool fast_accum) {
  Tensor ws = gemm_workspace(a);
  guarded(op, [&] {
    TensorView ov = view(out, "out"), wv = view(ws, "workspace");
    Fp8GemmOptions o;
    o.accumulate = accumulate;
    o.fast_accum = fast_accum;
    c10::OptionalDeviceGuard g(a.device());
    fp8_gemm(view(a, "a"), view(b, "b"), view(scale_a, "scale_a"), view(scale_b, "scale_b"), view(bias, "bias"), ov, o,
             wv, current_stream(a));
  });
}

int64_t rows(const Tensor& t) { return t.dim() == 2 ? t.size(0) : 0; }

// The first m rows of a padded copy (the a operand of a product with m real rows).
Tensor first_rows(const Tensor& q, int64_t m) { return q.dim() == 2 && q.size(0) > m ? q.narrow(0, 0, m) : q; }

// A new [m, n] product of a (its first m rows) and the padded b: computed into [m, rows(b)] and
// sliced to n columns (bias padded to rows(b) with zeros).
Tensor product(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
               const OptTensor& bias, int64_t m, int64_t n, bool fp32, bool fast_accum) {
  const int64_t nb = rows(b);
  Tensor out = at::empty({m, nb}, a.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  OptTensor bp = bias;
  if (bias.has_value() && bias->dim() == 1 && bias->size(0) < nb)
    bp = at::constant_pad_nd(*bias, {0, nb - bias->size(0)}, 0);
  gemm_into(op, first_rows(a, m), b, scale_a, scale_b, bp, out, false, fast_accum);
  return n < nb ? out.narrow(1, 0, n) : out;
}

Tensor fp8_gemm_impl(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                     const OptTensor& bias, bool out_fp32, bool fast_accum) {
  return product("fp8_gemm", a, b, scale_a, scale_b, bias, rows(a), rows(b), out_fp32, fast_accum);
}

// Into a caller's out [m, n] (m <= rows(a), n <= rows(b): the real sizes of padded copies): directly
// when it is contiguous with n = rows(b), else through a temporary that is then copied or added.
void gemm_to(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
             const Tensor& out, bool accumulate, bool fast_accum) {
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) <= rows(a) && out.size(1) <= rows(b), "mmfuse.", op,
                    ": out: expected [m, n] with m <= ", rows(a), " (rows of a) and n <= ", rows(b),
                    " (rows of b), got ", out.sizes());
  const int64_t m = out.size(0), n = out.size(1);
  const bool direct = m == 0 || (n == rows(b) && out.is_contiguous());
  if (direct) return gemm_into(op, first_rows(a, m), b, scale_a, scale_b, std::nullopt, out, accumulate, fast_accum);
  Tensor tmp = product(op, a, b, scale_a, scale_b, std::nullopt, m, n, out.scalar_type() == at::kFloat, fast_accum);
  if (accumulate) out.add_(tmp);
  else out.copy_(tmp);
}

void fp8_gemm_out_impl(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                       const Tensor& out, bool accumulate, bool fast_accum) {
  gemm_to("fp8_gemm", a, b, scale_a, scale_b, out, accumulate, fast_accum);
}

// y = x @ w^T + bias with x [M, K] quantized (dynamic or delayed: `dynamic`, or per row; q for the
// GEMM, qt and its scales kept for dW when save_xt) and w quantized too (dynamic) unless its cached
// copies are given; x and w share one amax launch and one cast launch (per row: and one memset of the
// maxima). swiglu_x: x is the [gate | up] source [M, 2K] and the layer's input is swiglu(x), quantized
// straight from it (the SwiGLU output is never written: the down projection of a SwiGLU MLP).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> fp8_linear_forward_impl(
    const Tensor& x_in, const Tensor& w_in, const OptTensor& bias, Tensor& x_state, Tensor& w_state,
    const OptTensor& w_q, const OptTensor& w_qt, const OptTensor& w_scale_inv, bool dynamic, bool save_xt,
    bool save_wt, bool per_row, bool swiglu_x) {
  const Tensor x = kernel_ready(x_in);
  const bool cached = w_q.has_value();
  if (x.dim() == 2 && w_in.dim() == 2) {
    const int64_t k = swiglu_x ? x.size(1) / 2 : x.size(1);
    TORCH_CHECK_VALUE(w_in.size(1) == k && (!swiglu_x || x.size(1) % 2 == 0), "mmfuse.fp8_linear_forward: w: expected ",
                      swiglu_x ? "half of x's columns (swiglu_x: x is [M, 2K])" : "x's columns", " as in_features (",
                      swiglu_x ? "x " : "", x.sizes(), "), got w ", w_in.sizes());
  }
  TORCH_CHECK_VALUE(!cached || (w_scale_inv.has_value() && (!save_wt || w_qt.has_value())),
                    "mmfuse.fp8_linear_forward: w_q given: expected w_scale_inv",
                    save_wt ? " and w_qt (save_wt=True)" : "", " with it");
  Quantized xq, wq;
  guarded("fp8_linear_forward", [&] {
    Fp8QuantJob jobs[2];
    jobs[0] = make_job(x, x_state, true, save_xt, false, dynamic || per_row, per_row, xq, swiglu_x);
    int n = 1;
    if (!cached) jobs[n++] = make_job(kernel_ready(w_in), w_state, true, save_wt, false, true, per_row, wq);  // dynamic
    c10::OptionalDeviceGuard g(x.device());
    fp8_quantize(jobs, n, current_stream(x));
  });
  const Tensor& wq_use = cached ? *w_q : wq.q;
  const Tensor& ws_use = cached ? *w_scale_inv : wq.scale_inv;
  Tensor y = product("fp8_linear_forward", xq.q, wq_use, xq.scale_inv, ws_use, bias, rows(x), rows(w_in), false, true);
  const Tensor x_qt_si = save_xt ? xq.qt_scale_inv() : empty0(xq.scale_inv);
  if (!save_xt) xq.qt = at::empty({0}, xq.q.options());
  if (cached) wq = {empty0(xq.q), empty0(xq.q), empty0(xq.scale_inv), empty0(xq.scale_inv), Tensor()};
  else if (!save_wt) wq.qt = empty0(xq.q);
  return {y, xq.qt, x_qt_si, wq.q, wq.qt, wq.scale_inv, wq.scale_inv_t};
}

// dX = g @ w and dW = g^T @ x from the saved transposed copies x_qt [K, Mp] and w_qt [K, Np], the
// gradient quantized once (both copies in one pass); dW into main_grad (fp32, accumulated) when
// given, or in bf16 from x (not fp8) when x is given; db = column sums of g (fp32, then g's dtype),
// from the gradient's cast pass (a fixed order: deterministic). With swiglu_q / swiglu_scale_inv (a
// SwiGLU MLP's gate/up projection): g is the gradient of the SwiGLU output and the output gradient
// quantized is that of [gate | up], computed from the pack as it is cast (never written in bf16).
std::tuple<Tensor, Tensor, Tensor> fp8_linear_backward_impl(
    const Tensor& g_in, const Tensor& x_qt, const Tensor& x_scale_inv, const Tensor& w_qt, const Tensor& w_scale_inv,
    Tensor& g_state, int64_t k, bool dynamic, bool e5m2, bool need_dx, bool need_dw, bool need_db, bool dw_fp32,
    const std::optional<Tensor>& main_grad, const OptTensor& x, bool per_row, const OptTensor& swiglu_q,
    const OptTensor& swiglu_scale_inv) {
  const Tensor g = kernel_ready(g_in);
  const SwigluPack pack = swiglu_pack_arg("fp8_linear_backward", swiglu_q, swiglu_scale_inv);
  const bool packed = pack.given();
  // the gradient of a SwiGLU's [gate | up] input from its output's (g) and the pack: never written, so
  // no bf16 weight gradient from x and no column sums of it
  TORCH_CHECK_VALUE(!packed || (!x.has_value() && !need_db), "mmfuse.fp8_linear_backward: swiglu_q: expected ",
                    "x=None and need_db=False (the gradient is only quantized), got ", x.has_value() ? "x" : "need_db");
  const bool dw_fp8 = need_dw && !x.has_value();
  Quantized gq;
  Tensor dx = empty0(g), dw = empty0(g), db = empty0(g);
  const bool fused_db = need_db && (need_dx || dw_fp8);  // db from the gradient's cast, else a column sum
  Tensor col_sums, partials;
  if (need_dx || dw_fp8) {
    guarded("fp8_linear_backward", [&] {
      Fp8QuantJob j = make_job(g, g_state, need_dx, dw_fp8, e5m2, dynamic || per_row, per_row, gq, false, pack);
      if (fused_db) {
        const auto f32 = g.options().dtype(at::kFloat);
        col_sums = at::empty({g.dim() == 2 ? g.size(1) : 0}, f32);
        partials = at::empty({g.is_cuda() && g.dim() == 2 ? fp8_col_sum_partials(g.size(0), g.size(1)) : 0}, f32);
        j.col_sums = view(col_sums, "col_sums");
        j.partials = view(partials, "partials");
      }
      c10::OptionalDeviceGuard dg(g.device());
      fp8_quantize(&j, 1, current_stream(g));
    });
  }
  const int64_t m = rows(g), n = g.dim() == 2 ? g.size(1) * (packed ? 2 : 1) : 0;
  if (need_dx) {
    dx = product("fp8_linear_backward", gq.q, w_qt, gq.scale_inv, w_scale_inv, std::nullopt, m, k, false, false);
  }
  if (need_dw) {
    if (dw_fp8) {
      if (main_grad.has_value()) {
        gemm_to("fp8_linear_backward", gq.qt, x_qt, gq.qt_scale_inv(), x_scale_inv, *main_grad, true, false);
      } else {
        dw = product("fp8_linear_backward", gq.qt, x_qt, gq.qt_scale_inv(), x_scale_inv, std::nullopt, n, k, dw_fp32,
                     false);
      }
    } else {  // bf16 weight gradient: g^T @ x on the tensor cores in g's dtype, fp32 accumulation
      Tensor d = at::mm(g.t(), *x);
      if (main_grad.has_value()) main_grad->add_(d);
      else dw = dw_fp32 ? d.to(at::kFloat) : d;
    }
  }
  if (need_db) db = (fused_db ? col_sums : g.sum(0, false, at::kFloat)).to(g.scalar_type());
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) {
  m.impl("fp8_quantize", &fp8_quantize_impl);
  m.impl("fp8_transpose", &fp8_transpose_impl);
  m.impl("fp8_gemm", &fp8_gemm_impl);
  m.impl("fp8_gemm_out", &fp8_gemm_out_impl);
  m.impl("fp8_linear_forward", &fp8_linear_forward_impl);
  m.impl("fp8_linear_backward", &fp8_linear_backward_impl);
}
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) {
  m.impl("fp8_quantize", &fp8_quantize_impl);
  m.impl("fp8_transpose", &fp8_transpose_impl);
  m.impl("fp8_gemm", &fp8_gemm_impl);
  m.impl("fp8_gemm_out", &fp8_gemm_out_impl);
  m.impl("fp8_linear_forward", &fp8_linear_forward_impl);
  m.impl("fp8_linear_backward", &fp8_linear_backward_impl);
}

}  // namespace mmfuse::torch_bind
