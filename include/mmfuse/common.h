// mmfuse core: shared vocabulary of every op (dtype, device, tensor view, error).
//
// The core never includes a torch header. A TensorView is a non-owning description of a strided
// tensor (pointer, dtype, device, shape, strides in elements). Ops take views and a cudaStream_t,
// never allocate, never synchronize, and report bad input by throwing mmfuse::Error, whose message
// names the argument, the expected and the actual value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#if defined(_WIN32)
#define MMFUSE_API __declspec(dllexport)
#else
#define MMFUSE_API __attribute__((visibility("default")))
#endif

// The stream type of the core's entry points; a plain pointer when built without CUDA.
typedef struct CUstream_st* cudaStream_t;

namespace mmfuse {

enum class DType : int8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat64,
  kInt32,
  kInt64,
  kUInt8,
  kFloat8E4M3,
  kFloat8E5M2,
};

MMFUSE_API const char* dtype_name(DType t);
MMFUSE_API std::size_t dtype_size(DType t);

enum class DeviceType : int8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

MMFUSE_API std::string device_name(Device d);

// For tests and measurements only: forces an automatic kernel-path choice of the CUDA backends, named
// by its environment variable (MMFUSE_MOE_PLAN, MMFUSE_MOE_PLAN_HIST, MMFUSE_MOE_BWD; "auto" restores
// the rule). Every path computes the same bits. Throws, naming the choices, on an unknown name or value.
MMFUSE_API void set_path_override(const std::string& name, const std::string& value);

constexpr int kMaxDims = 8;

// Non-owning strided view. shape/stride in elements; stride of a size-1 dim is irrelevant.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = -1;  // -1: absent (an optional argument that was not given)
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};

  bool defined() const { return ndim >= 0; }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t strides(int d) const { return stride[d < 0 ? d + ndim : d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// Builds a view; used by tests and by the bindings.
MMFUSE_API TensorView make_view(void* data, DType dtype, Device device, int ndim,
                                const int64_t* shape, const int64_t* stride);
MMFUSE_API TensorView make_contiguous_view(void* data, DType dtype, Device device, int ndim,
                                           const int64_t* shape);
MMFUSE_API std::string shape_str(const TensorView& v);

// The one error type of the core. what() = "file:line: message".
class MMFUSE_API Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& msg);
  const std::string& message() const { return msg_; }

 private:
  std::string msg_;
};

namespace detail {
// Message building without iostreams (no locale machinery in the error path of an extension).
inline void append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, const char* v) { s.append(v ? v : "(null)"); }
inline void append(std::string& s, char v) { s.push_back(v); }
template <class T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, char>, int> = 0>
void append(std::string& s, T v) {
  if constexpr (std::is_same_v<T, bool>) s.append(v ? "true" : "false");
  else s.append(std::to_string(v));
}
template <class... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace mmfuse

// Throws mmfuse::Error with file:line and the concatenated message when cond is false.
#define MMFUSE_CHECK(cond, ...)                                                       \
  do {                                                                                \
    if (!(cond)) throw ::mmfuse::Error(__FILE__, __LINE__, ::mmfuse::detail::cat(__VA_ARGS__)); \
  } while (0)

#define MMFUSE_FAIL(...) throw ::mmfuse::Error(__FILE__, __LINE__, ::mmfuse::detail::cat(__VA_ARGS__))
