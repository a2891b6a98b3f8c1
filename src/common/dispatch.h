// One lambda-based dtype dispatch for the whole core (no copy-pasted switches).
#pragma once

#include "mmfuse/common.h"
#include "common/numerics.h"

namespace mmfuse {

template <class T>
struct TypeTag {
  using type = T;
};

// Floating storage types: calls f(TypeTag<T>{}) with T in {float, double, bf16, f16}.
template <class F>
decltype(auto) dispatch_floating(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kFloat32: return f(TypeTag<float>{});
    case DType::kFloat64: return f(TypeTag<double>{});
    case DType::kBFloat16: return f(TypeTag<bf16>{});
    case DType::kFloat16: return f(TypeTag<f16>{});
    default: MMFUSE_FAIL(what, ": expected dtype float32, float64, bfloat16 or float16, got ", dtype_name(t));
  }
}

// Index types: calls f(TypeTag<T>{}) with T in {int32_t, int64_t}.
template <class F>
decltype(auto) dispatch_index(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kInt32: return f(TypeTag<int32_t>{});
    case DType::kInt64: return f(TypeTag<int64_t>{});
    default: MMFUSE_FAIL(what, ": expected dtype int32 or int64, got ", dtype_name(t));
  }
}

// The error of an op given CUDA tensors in a build without the CUDA backend.
[[noreturn]] inline void no_cuda_backend(const char* op) {
  MMFUSE_FAIL(op, ": this build of mmfuse has no CUDA backend (built with MMFUSE_CUDA=OFF)");
}

// The caller's CUDA workspace of an op: a contiguous 1-D buffer of at least `bytes` on `dev`.
inline void check_workspace(const char* op, const TensorView& ws, Device dev, int64_t bytes) {
  MMFUSE_CHECK(ws.defined() && ws.device == dev && ws.ndim == 1 && (ws.shape[0] <= 1 || ws.stride[0] == 1) &&
                   int64_t(ws.shape[0] * dtype_size(ws.dtype)) >= bytes,
               op, ": workspace: expected a contiguous buffer of >= ", bytes, " bytes on ", device_name(dev), ", got ",
               ws.defined() ? shape_str(ws) : std::string("none"));
}

// The CUDA backend call of an entry point (the expression after stream), or the no-CUDA-backend
// error in a build without CUDA (where the backend functions are not declared).
#ifdef MMFUSE_WITH_CUDA
#define MMFUSE_CUDA_BACKEND(op, stream, ...) __VA_ARGS__
#else
#define MMFUSE_CUDA_BACKEND(op, stream, ...) ((void)(stream), ::mmfuse::no_cuda_backend(op))
#endif

// Element (i, j) of a 2-D int32 / int64 view, widened to int64 (host views; dtype already checked).
inline int64_t index_at(const TensorView& v, int64_t i, int64_t j) {
  const int64_t off = i * v.stride[0] + j * v.stride[1];
  return v.dtype == DType::kInt32 ? int64_t(static_cast<const int32_t*>(v.data)[off])
                                  : static_cast<const int64_t*>(v.data)[off];
}

}  // namespace mmfuse
