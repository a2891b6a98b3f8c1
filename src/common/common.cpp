#include "mmfuse/common.h"

#include <cstring>

namespace mmfuse {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  return "unknown";
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kUInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: return 1;
  }
  return 0;
}

std::string device_name(Device d) {
  return d.type == DeviceType::kCPU ? std::string("cpu") : detail::cat("cuda:", d.index);
}

TensorView make_view(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
                     const int64_t* stride) {
  MMFUSE_CHECK(ndim >= 0 && ndim <= kMaxDims, "make_view: ndim must be in [0, ", kMaxDims, "], got ", ndim);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = ndim;
  for (int i = 0; i < ndim; ++i) {
    v.shape[i] = shape[i];
    v.stride[i] = stride[i];
  }
  return v;
}

TensorView make_contiguous_view(void* data, DType dtype, Device device, int ndim, const int64_t* shape) {
  int64_t stride[kMaxDims];
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    stride[i] = s;
    s *= shape[i];
  }
  return make_view(data, dtype, device, ndim, shape, stride);
}

std::string shape_str(const TensorView& v) {
  if (!v.defined()) return "(absent)";
  std::string s = "[";
  for (int i = 0; i < v.ndim; ++i) s += detail::cat(i ? ", " : "", v.shape[i]);
  return s + "]";
}

static std::string strip_path(const char* file) {
  const char* p = std::strrchr(file, '/');
  return p ? p + 1 : file;
}

Error::Error(const char* file, int line, const std::string& msg)
    : std::runtime_error(detail::cat(msg, " (", strip_path(file), ":", line, ")")), msg_(msg) {}

}  // namespace mmfuse
