// Dual-expert GEMM entry point: validate both problems, then call the backend.
#include "backends/dual_gemm.h"
#include "mmfuse/dual_gemm.h"

#include <string>

#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {
namespace {

struct Dims {
  int64_t m, n, k;
};

// Checks one expert's a, w and out; returns its (m, n, k).
Dims check_expert(const char* op, int e, const TensorView& a, const TensorView& w, const TensorView& out,
                  const DualGemmOptions& o, DType in, Device dev) {
  const std::string an = "a" + std::to_string(e), wn = "w" + std::to_string(e), on = "out" + std::to_string(e);
  for (const auto& [v, name] : {std::pair<const TensorView*, const std::string*>{&a, &an}, {&w, &wn}, {&out, &on}}) {
    MMFUSE_CHECK(v->defined(), op, ": ", *name, " is missing");
    MMFUSE_CHECK(v->ndim == 2, op, ": ", *name, ": expected a 2-D tensor, got ", shape_str(*v));
    MMFUSE_CHECK(v->device == dev, op, ": ", *name, ": expected a tensor on ", device_name(dev), " (that of a0), got ",
                 device_name(v->device));
  }
  for (const auto& [v, name] : {std::pair<const TensorView*, const std::string*>{&a, &an}, {&w, &wn}}) {
    MMFUSE_CHECK(v->dtype == in, op, ": ", *name, ": expected dtype ", dtype_name(in), " (that of a0), got ",
                 dtype_name(v->dtype));
    if (v->shape[0] == 0 || v->shape[1] == 0) continue;  // no elements: the strides do not matter
    MMFUSE_CHECK(v->shape[1] <= 1 || v->stride[1] == 1, op, ": ", *name,
                 ": the last dim must be contiguous, got strides [", v->stride[0], ", ", v->stride[1], "]");
    MMFUSE_CHECK(v->shape[0] <= 1 || v->stride[0] >= v->shape[1], op, ": ", *name, ": row stride ", v->stride[0],
                 " is below its ", v->shape[1], " columns");
  }
  const int64_t m = o.trans_a ? a.shape[1] : a.shape[0], k = o.trans_a ? a.shape[0] : a.shape[1];
  const int64_t wk = o.trans_b ? w.shape[1] : w.shape[0], n = o.trans_b ? w.shape[0] : w.shape[1];
  MMFUSE_CHECK(wk == k, op, ": ", wn, ": expected ", k, " along its k dim (that of ", an, "; trans_a=",
               o.trans_a ? "True" : "False", ", trans_b=", o.trans_b ? "True" : "False", "), got shape ",
               shape_str(w));
  MMFUSE_CHECK(out.shape[0] == m && out.shape[1] == n, op, ": ", on, ": expected shape [", m, ", ", n, "], got ",
               shape_str(out));
  const bool empty = out.shape[0] == 0 || out.shape[1] == 0;
  const bool dense = (out.shape[1] <= 1 || out.stride[1] == 1) && (out.shape[0] <= 1 || out.stride[0] == out.shape[1]);
  MMFUSE_CHECK(empty || dense, op,
               ": ", on, ": expected a contiguous tensor (outputs are written in place), got strides [",
               out.stride[0], ", ", out.stride[1], "]");
  MMFUSE_CHECK(out.dtype == in || out.dtype == DType::kFloat32, op, ": ", on, ": expected dtype ", dtype_name(in),
               " (that of the inputs) or float32, got ", dtype_name(out.dtype));
  MMFUSE_CHECK(!o.accumulate || out.dtype == DType::kFloat32 || in == DType::kFloat64, op, ": ", on,
               ": accumulate=True needs a float32 output, got ", dtype_name(out.dtype));
  return {m, n, k};
}

}  // namespace

int64_t dual_gemm_workspace_bytes() { return int64_t(32) << 20; }  // cuBLAS's recommendation for Hopper

void dual_gemm_check(const TensorView& a0, const TensorView& w0, const TensorView& out0, const TensorView& a1,
                     const TensorView& w1, const TensorView& out1, const DualGemmOptions& o) {
  const char* op = "dual_gemm";
  MMFUSE_CHECK(a0.defined(), op, ": a0 is missing");
  const DType in = a0.dtype;
  MMFUSE_CHECK(in == DType::kBFloat16 || in == DType::kFloat16 || in == DType::kFloat32 || in == DType::kFloat64,
               op, ": a0: expected dtype bfloat16, float16, float32 or float64, got ", dtype_name(in));
  const Device dev = a0.device;
  check_expert(op, 0, a0, w0, out0, o, in, dev);
  check_expert(op, 1, a1, w1, out1, o, in, dev);
  MMFUSE_CHECK(dev.type == DeviceType::kCPU || in != DType::kFloat64, op,
               ": a0: float64 is CPU only (for gradcheck)");
  // an output written over an input, or both outputs in one tensor, would be read after written
  check_outputs_separate(op, {{&out0, "out0"}, {&out1, "out1"}},
                         {{&a0, "a0"}, {&w0, "w0"}, {&a1, "a1"}, {&w1, "w1"}});
}

void dual_gemm(const TensorView& a0, const TensorView& w0, TensorView& out0, const TensorView& a1,
               const TensorView& w1, TensorView& out1, const DualGemmOptions& o, TensorView& ws,
               cudaStream_t stream) {
  const char* op = "dual_gemm";
  dual_gemm_check(a0, w0, out0, a1, w1, out1, o);
  const Device dev = a0.device;
  if (dev.type == DeviceType::kCPU) {
    detail::gemm_cpu(a0, w0, out0, o);
    detail::gemm_cpu(a1, w1, out1, o);
    return;
  }
  check_workspace(op, ws, dev, dual_gemm_workspace_bytes());
  MMFUSE_CUDA_BACKEND(op, stream, detail::dual_gemm_cuda(a0, w0, out0, a1, w1, out1, o, ws, stream));
}

}  // namespace mmfuse
