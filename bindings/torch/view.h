// Shared helpers of the torch bindings: at::Tensor -> mmfuse::TensorView, the current stream, and
// the translation of mmfuse::Error into a Python ValueError.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#ifdef MMFUSE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>
#include <string>

#include "mmfuse/common.h"

namespace mmfuse::torch_bind {

inline DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DType::kFloat8E5M2;
    default: TORCH_CHECK_TYPE(false, name, ": unsupported dtype ", t);
  }
}

inline TensorView view(const at::Tensor& t, const char* name) {
  TensorView v;
  if (!t.defined()) return v;
  TORCH_CHECK_VALUE(t.dim() <= kMaxDims, name, ": at most ", kMaxDims, " dims, got ", t.dim());
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), name, ": expected a CPU or CUDA tensor, got ",
                    t.device());
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type(), name);
  v.device = t.device().is_cpu() ? Device{DeviceType::kCPU, 0} : Device{DeviceType::kCUDA, t.device().index()};
  v.ndim = int(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  return v;
}

inline TensorView view(const std::optional<at::Tensor>& t, const char* name) {
  return t.has_value() ? view(*t, name) : TensorView{};
}

inline cudaStream_t current_stream(const at::Tensor& t) {
#ifdef MMFUSE_WITH_CUDA
  if (t.is_cuda()) return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  (void)t;
  return nullptr;
}

// A read-only input as the kernels read it: t itself when its last dim is contiguous and its rows do
// not overlap, else a contiguous copy. Gradients from autograd and callers' inputs can be expanded
// (stride 0) or strided in the last dim; an output or an in-place operand never goes through here.
inline at::Tensor kernel_ready(const at::Tensor& t) {
  if (t.dim() == 0) return t;
  if (t.size(-1) > 1 && t.stride(-1) != 1) return t.contiguous();
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) < t.size(-1)) return t.contiguous();  // rows that overlap (expanded)
  return t;
}

// Runs fn, turning mmfuse::Error into c10::ValueError (Python ValueError) with the core's message.
// The torch error is thrown after the handler has finished, not from inside it.
template <class F>
void guarded(const char* op, F&& fn) {
  std::string message;
  try {
    fn();
    return;
  } catch (const mmfuse::Error& e) {
    message = e.what();
  }
  // The core's messages start with the op's name: say it once, as "mmfuse.<op>: ...".
  const std::string prefix = std::string(op) + ": ";
  if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
  TORCH_CHECK_VALUE(false, "mmfuse.", op, ": ", message);
}

}  // namespace mmfuse::torch_bind
