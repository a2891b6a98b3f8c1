// Torch implementation of SwiGLU and its backward (CPU and CUDA through the core). Autograd:
// python/mmfuse/swiglu.py.
#include <torch/library.h>

#include "mmfuse/swiglu.h"
#include "view.h"

namespace mmfuse::torch_bind {
namespace {

using at::Tensor;

int64_t rows_of(const Tensor& t) { return t.dim() == 2 ? t.size(0) : 0; }
int64_t half_cols(const Tensor& t) { return t.dim() == 2 ? t.size(1) / 2 : 0; }

Tensor swiglu_impl(const Tensor& gate_up_in) {
  const Tensor gate_up = kernel_ready(gate_up_in);
  Tensor out = at::empty({rows_of(gate_up), half_cols(gate_up)}, gate_up.options());
  guarded("swiglu", [&] {
    TensorView ov = view(out, "out");
    c10::OptionalDeviceGuard g(gate_up.device());
    swiglu(view(gate_up, "gate_up"), ov, current_stream(gate_up));
  });
  return out;
}

// The backward's outputs, d_gate_up [T, 2I] and y ([T, I], or [0, I] without recompute), with `opts`,
// written by run(d_gate_up, y, stream) under op's error handling, on the device and stream of `on`.
template <class Run>
std::tuple<Tensor, Tensor> backward_outputs(const char* op, int64_t T, int64_t I, bool recompute,
                                            const at::TensorOptions& opts, const Tensor& on, Run run) {
  Tensor dgu = at::empty({T, 2 * I}, opts);
  Tensor y = at::empty({recompute ? T : 0, I}, opts);
  guarded(op, [&] {
    TensorView dv = view(dgu, "d_gate_up"), yv = recompute ? view(y, "y") : TensorView{};
    c10::OptionalDeviceGuard g(on.device());
    run(dv, yv, current_stream(on));
  });
  return {dgu, y};
}

std::tuple<Tensor, Tensor> swiglu_backward_impl(const Tensor& dy_in, const Tensor& gate_up_in, bool recompute) {
  const Tensor dy = kernel_ready(dy_in), gate_up = kernel_ready(gate_up_in);
  return backward_outputs("swiglu_backward", rows_of(gate_up), half_cols(gate_up), recompute, gate_up.options(),
                          gate_up, [&](TensorView& dv, TensorView& yv, cudaStream_t st) {
                            swiglu_backward(view(dy, "dy"), view(gate_up, "gate_up"), dv, yv, st);
                          });
}

// In place: no contiguous copy to write into (the core refuses a last dim with a stride).
void swiglu_backward_inplace_impl(const Tensor& dy, const Tensor& gate_up, bool recompute) {
  guarded("swiglu_backward_", [&] {
    TensorView dv = view(gate_up, "gate_up"), dyv = view(dy, "dy"), yv = recompute ? dyv : TensorView{};
    c10::OptionalDeviceGuard g(gate_up.device());
    swiglu_backward(dyv, dv, dv, yv, current_stream(gate_up));
  });
}

std::tuple<Tensor, Tensor> swiglu_pack_fp8_impl(const Tensor& gate_up_in) {
  const Tensor gate_up = kernel_ready(gate_up_in);
  const int64_t T = rows_of(gate_up), C2 = 2 * half_cols(gate_up);
  Tensor q = at::empty({T, C2}, gate_up.options().dtype(at::kFloat8_e4m3fn));
  Tensor si = at::empty({T, swiglu_pack_tiles(C2)}, gate_up.options().dtype(at::kFloat));
  guarded("swiglu_pack_fp8", [&] {
    TensorView qv = view(q, "q"), sv = view(si, "scale_inv");
    c10::OptionalDeviceGuard g(gate_up.device());
    swiglu_pack_fp8(view(gate_up, "gate_up"), qv, sv, current_stream(gate_up));
  });
  return {q, si};
}

std::tuple<Tensor, Tensor> swiglu_backward_fp8_impl(const Tensor& dy_in, const Tensor& q_in, const Tensor& si_in,
                                                     bool recompute) {
  const Tensor dy = kernel_ready(dy_in), q = kernel_ready(q_in), si = kernel_ready(si_in);
  return backward_outputs("swiglu_backward_fp8", rows_of(q), half_cols(q), recompute, dy.options(), q,
                          [&](TensorView& dv, TensorView& yv, cudaStream_t st) {
                            swiglu_backward_fp8(view(dy, "dy"), view(q, "q"), view(si, "scale_inv"), dv, yv, st);
                          });
}

void register_swiglu(torch::Library& m) {
  m.impl("swiglu_pack_fp8", &swiglu_pack_fp8_impl);
  m.impl("swiglu_backward_fp8", &swiglu_backward_fp8_impl);
  m.impl("swiglu", &swiglu_impl);
  m.impl("swiglu_backward", &swiglu_backward_impl);
  m.impl("swiglu_backward_", &swiglu_backward_inplace_impl);
}

}  // namespace

TORCH_LIBRARY_IMPL(mmfuse, CPU, m) { register_swiglu(m); }
TORCH_LIBRARY_IMPL(mmfuse, CUDA, m) { register_swiglu(m); }

}  // namespace mmfuse::torch_bind
