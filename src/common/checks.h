// Argument checks shared by the entry points: each names the op, the argument, the expected and the
// actual value.
#pragma once

#include <string>

#include "mmfuse/common.h"

namespace mmfuse {

// " (that of <ref>)" where ref is given: what an expectation was taken from.
inline std::string that_of(const char* ref) { return ref ? std::string(" (that of ") + ref + ")" : std::string(); }

// A [rows, cols] matrix of dtype dt on dev, its last dim contiguous and its rows at least cols apart.
inline void check_matrix(const char* op, const TensorView& v, const char* name, int64_t rows, int64_t cols, DType dt,
                         Device dev, const char* ref = nullptr) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.ndim == 2 && v.shape[0] == rows && v.shape[1] == cols, op, ": ", name, ": expected shape [", rows,
               ", ", cols, "], got ", shape_str(v));
  MMFUSE_CHECK(v.dtype == dt, op, ": ", name, ": expected dtype ", dtype_name(dt), that_of(ref), ", got ",
               dtype_name(v.dtype));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected a tensor on ", device_name(dev), that_of(ref), ", got ",
               device_name(v.device));
  MMFUSE_CHECK(cols <= 1 || rows == 0 || v.stride[1] == 1, op, ": ", name,
               ": the last dim must be contiguous, got strides [", v.stride[0], ", ", v.stride[1], "]");
  MMFUSE_CHECK(rows <= 1 || v.stride[0] >= cols, op, ": ", name, ": row stride ", v.stride[0], " is below its ", cols,
               " columns");
}

// A contiguous vector of n elements of dtype dt on dev.
inline void check_vector(const char* op, const TensorView& v, const char* name, int64_t n, DType dt, Device dev) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.ndim == 1 && v.shape[0] == n, op, ": ", name, ": expected shape [", n, "], got ", shape_str(v));
  MMFUSE_CHECK(v.dtype == dt, op, ": ", name, ": expected dtype ", dtype_name(dt), ", got ", dtype_name(v.dtype));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected a tensor on ", device_name(dev), ", got ",
               device_name(v.device));
  MMFUSE_CHECK(n <= 1 || v.stride[0] == 1, op, ": ", name, ": expected a contiguous vector, got stride ", v.stride[0]);
}

}  // namespace mmfuse
