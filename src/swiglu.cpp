// SwiGLU entry points: validate the views, then call the CPU or CUDA backend.
#include "backends/swiglu.h"
#include "mmfuse/swiglu.h"

#include <string>

#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {
namespace {

void check_rows(const char* op, const TensorView& v, const char* name, int64_t T, int64_t C, DType dt, Device dev) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.ndim == 2 && v.shape[0] == T && v.shape[1] == C, op, ": ", name, ": expected shape [", T, ", ", C,
               "], got ", shape_str(v));
  MMFUSE_CHECK(v.dtype == dt, op, ": ", name, ": expected dtype ", dtype_name(dt), " (that of gate_up), got ",
               dtype_name(v.dtype));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected a tensor on ", device_name(dev), " (that of gate_up), got ",
               device_name(v.device));
  MMFUSE_CHECK(C <= 1 || T == 0 || v.stride[1] == 1, op, ": ", name, ": the last dim must be contiguous, got strides [",
               v.stride[0], ", ", v.stride[1], "]");
  MMFUSE_CHECK(T <= 1 || v.stride[0] >= C, op, ": ", name, ": row stride ", v.stride[0], " is below its ", C,
               " columns");
}

// gate_up's [T, 2I]; returns I.
int64_t check_gate_up(const char* op, const TensorView& gu) {
  MMFUSE_CHECK(gu.defined() && gu.ndim == 2, op, ": gate_up: expected a 2-D tensor [T, 2I], got ",
               gu.defined() ? shape_str(gu) : std::string("none"));
  MMFUSE_CHECK(gu.shape[1] % 2 == 0, op, ": gate_up: expected an even number of columns (gate, then up), got ",
               gu.shape[1]);
  dispatch_floating(gu.dtype, (std::string(op) + ": gate_up").c_str(), [](auto) {});
  MMFUSE_CHECK(gu.device.type == DeviceType::kCPU || gu.dtype != DType::kFloat64, op, ": gate_up: float64 is CPU only");
  check_rows(op, gu, "gate_up", gu.shape[0], gu.shape[1], gu.dtype, gu.device);
  return gu.shape[1] / 2;
}

}  // namespace

void swiglu(const TensorView& gate_up, TensorView& out, cudaStream_t stream) {
  const char* op = "swiglu";
  const int64_t I = check_gate_up(op, gate_up), T = gate_up.shape[0];
  check_rows(op, out, "out", T, I, gate_up.dtype, gate_up.device);
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
  check_rows(op, dy, "dy", T, I, dt, dev);
  check_rows(op, d_gate_up, "d_gate_up", T, 2 * I, dt, dev);
  if (y.defined()) check_rows(op, y, "y", T, I, dt, dev);
  for (const auto& [in, in_name] : {std::pair<const TensorView*, const char*>{&dy, "dy"}, {&gate_up, "gate_up"}}) {
    check_no_overlap(op, d_gate_up, "d_gate_up", *in, in_name);
    check_no_overlap(op, y, "y", *in, in_name);
  }
  check_no_overlap(op, y, "y", d_gate_up, "d_gate_up");
  if (T == 0 || I == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::swiglu_backward_cpu(dy, gate_up, d_gate_up, y);
  MMFUSE_CUDA_BACKEND(op, stream, detail::swiglu_backward_cuda(dy, gate_up, d_gate_up, y, stream));
}

}  // namespace mmfuse
