// SwiGLU entry points: validate the views, then call the CPU or CUDA backend.
#include "backends/swiglu.h"
#include "mmfuse/swiglu.h"

#include <initializer_list>
#include <string>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {
namespace {

// gate_up's [T, 2I]; returns I.
int64_t check_gate_up(const char* op, const TensorView& gu) {
  MMFUSE_CHECK(gu.defined() && gu.ndim == 2, op, ": gate_up: expected a 2-D tensor [T, 2I], got ",
               gu.defined() ? shape_str(gu) : std::string("none"));
  MMFUSE_CHECK(gu.shape[1] % 2 == 0, op, ": gate_up: expected an even number of columns (gate, then up), got ",
               gu.shape[1]);
  dispatch_floating(gu.dtype, (std::string(op) + ": gate_up").c_str(), [](auto) {});
  MMFUSE_CHECK(gu.device.type == DeviceType::kCPU || gu.dtype != DType::kFloat64, op, ": gate_up: float64 is CPU only");
  check_matrix(op, gu, "gate_up", gu.shape[0], gu.shape[1], gu.dtype, gu.device);
  return gu.shape[1] / 2;
}

// dy [T, I], d_gate_up [T, 2I] and y [T, I] (optional) of dtype dt on dev, and the sharing rule: y may be
// dy itself and d_gate_up the input `in_place` names (the exact in-place pairs); any other output / input
// sharing, and an expanded output, is an error.
void check_backward_views(const char* op, const TensorView& dy, const TensorView& d_gate_up, const TensorView& y,
                          int64_t T, int64_t I, DType dt, Device dev, const char* ref,
                          std::initializer_list<NamedView> inputs, const TensorView* in_place) {
  check_matrix(op, dy, "dy", T, I, dt, dev, ref);
  check_matrix(op, d_gate_up, "d_gate_up", T, 2 * I, dt, dev, ref);
  if (y.defined()) check_matrix(op, y, "y", T, I, dt, dev, ref);
  check_not_expanded(op, d_gate_up, "d_gate_up");
  check_not_expanded(op, y, "y");
  for (const NamedView& in : inputs)
    if (in.v != in_place || !same_view(d_gate_up, *in.v))
      check_no_overlap(op, d_gate_up, "d_gate_up", *in.v, in.name);
  check_no_overlap(op, d_gate_up, "d_gate_up", dy, "dy");
  if (!y.defined()) return;
  if (!same_view(y, dy)) check_no_overlap(op, y, "y", dy, "dy");
  for (const NamedView& in : inputs) check_no_overlap(op, y, "y", *in.v, in.name);
  check_no_overlap(op, y, "y", d_gate_up, "d_gate_up");
}

}  // namespace

void swiglu(const TensorView& gate_up, TensorView& out, cudaStream_t stream) {
  const char* op = "swiglu";
  const int64_t I = check_gate_up(op, gate_up), T = gate_up.shape[0];
  check_matrix(op, out, "out", T, I, gate_up.dtype, gate_up.device, "gate_up");
  check_no_overlap(op, out, "out", gate_up, "gate_up");
  if (T == 0 || I == 0) return;
  if (gate_up.device.type == DeviceType::kCPU) return detail::swiglu_cpu(gate_up, out);
  MMFUSE_CUDA_BACKEND(op, stream, detail::swiglu_cuda(gate_up, out, stream));
}

void swiglu_backward(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y,
                     cudaStream_t stream) {
  const char* op = "swiglu_backward";
  const int64_t I = check_gate_up(op, gate_up), T = gate_up.shape[0];
  const DType dt = gate_up.dtype;
  const Device dev = gate_up.device;
  check_backward_views(op, dy, d_gate_up, y, T, I, dt, dev, "gate_up", {{&gate_up, "gate_up"}}, &gate_up);
  if (T == 0 || I == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::swiglu_backward_cpu(dy, gate_up, d_gate_up, y);
  MMFUSE_CUDA_BACKEND(op, stream, detail::swiglu_backward_cuda(dy, gate_up, d_gate_up, y, stream));
}

void swiglu_pack_fp8(const TensorView& gate_up, TensorView& q, TensorView& scale_inv, cudaStream_t stream) {
  const char* op = "swiglu_pack_fp8";
  const int64_t I = check_gate_up(op, gate_up), T = gate_up.shape[0];
  MMFUSE_CHECK(gate_up.dtype != DType::kFloat64, op, ": gate_up: expected bfloat16, float16 or float32, got float64");
  const int64_t tiles = swiglu_pack_tiles(2 * I);
  check_matrix(op, q, "q", T, 2 * I, DType::kFloat8E4M3, gate_up.device);
  check_matrix(op, scale_inv, "scale_inv", T, tiles, DType::kFloat32, gate_up.device);
  check_not_expanded(op, q, "q");
  check_not_expanded(op, scale_inv, "scale_inv");
  check_no_overlap(op, q, "q", gate_up, "gate_up");
  check_no_overlap(op, scale_inv, "scale_inv", gate_up, "gate_up");
  check_no_overlap(op, scale_inv, "scale_inv", q, "q");
  if (T == 0 || I == 0) return;
  if (gate_up.device.type == DeviceType::kCPU) return detail::swiglu_pack_fp8_cpu(gate_up, q, scale_inv);
  MMFUSE_CUDA_BACKEND(op, stream, detail::swiglu_pack_fp8_cuda(gate_up, q, scale_inv, stream));
}

void swiglu_backward_fp8(const TensorView& dy, const TensorView& q, const TensorView& scale_inv,
                         TensorView& d_gate_up, TensorView& y, cudaStream_t stream) {
  const char* op = "swiglu_backward_fp8";
  MMFUSE_CHECK(q.defined() && q.ndim == 2 && q.shape[1] % 2 == 0, op,
               ": q: expected a 2-D tensor [T, 2I] (swiglu_pack_fp8's), got ",
               q.defined() ? shape_str(q) : std::string("none"));
  const int64_t T = q.shape[0], I = q.shape[1] / 2;
  const int64_t tiles = swiglu_pack_tiles(2 * I);
  const Device dev = q.device;
  check_matrix(op, q, "q", T, 2 * I, DType::kFloat8E4M3, dev);
  check_matrix(op, scale_inv, "scale_inv", T, tiles, DType::kFloat32, dev);
  MMFUSE_CHECK(dy.defined(), op, ": dy is missing");
  MMFUSE_CHECK(dy.dtype == DType::kBFloat16 || dy.dtype == DType::kFloat16 || dy.dtype == DType::kFloat32, op,
               ": dy: expected bfloat16, float16 or float32, got ", dtype_name(dy.dtype));
  check_backward_views(op, dy, d_gate_up, y, T, I, dy.dtype, dev, nullptr, {{&q, "q"}, {&scale_inv, "scale_inv"}},
                       nullptr);
  if (T == 0 || I == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::swiglu_backward_fp8_cpu(dy, q, scale_inv, d_gate_up, y);
  MMFUSE_CUDA_BACKEND(op, stream, detail::swiglu_backward_fp8_cuda(dy, q, scale_inv, d_gate_up, y, stream));
}

}  // namespace mmfuse
