// Shared helpers of the C++ tests: seeded random host buffers, poisoning, views, device buffers.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "common/overrides.h"
#include "mmfuse/common.h"

#ifdef MMFUSE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace mmfuse::test {

// Seed from the running test's full name, so every test draws its own reproducible inputs.
inline uint64_t test_seed() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "." + info->name();
  return std::hash<std::string>{}(name);
}

template <class T>
DType dtype_of();
template <> inline DType dtype_of<float>() { return DType::kFloat32; }
template <> inline DType dtype_of<double>() { return DType::kFloat64; }
template <> inline DType dtype_of<bf16>() { return DType::kBFloat16; }
template <> inline DType dtype_of<f16>() { return DType::kFloat16; }
template <> inline DType dtype_of<int32_t>() { return DType::kInt32; }
template <> inline DType dtype_of<int64_t>() { return DType::kInt64; }

// The unit roundoff of a storage type (half its precision: the error bound of one rounding).
template <class S>
double unit_roundoff() {
  if constexpr (std::is_same_v<S, bf16>) return std::ldexp(1.0, -8);
  if constexpr (std::is_same_v<S, f16>) return std::ldexp(1.0, -11);
  if constexpr (std::is_same_v<S, float>) return std::ldexp(1.0, -24);
  return std::ldexp(1.0, -53);
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, bf16>) return to_bf16(float(v));
  else if constexpr (std::is_same_v<T, f16>) return to_f16(float(v));
  else return T(v);
}
template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) return double(to_float(v));
  else return double(v);
}

template <class T>
std::vector<T> random_vec(size_t n, std::mt19937_64& rng, double lo = -2.0, double hi = 2.0) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = from_double<T>(d(rng));
  return v;
}

// Fill with 0xFF bytes: NaN for every float format, so unwritten outputs are caught.
template <class T>
void poison(std::vector<T>& v) {
  std::memset(static_cast<void*>(v.data()), 0xFF, v.size() * sizeof(T));
}

template <class T>
bool bits_equal(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// f() must throw mmfuse::Error with a message containing needle.
inline void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

inline TensorView host_view(void* p, DType t, std::vector<int64_t> shape, std::vector<int64_t> stride = {}) {
  if (stride.empty()) return make_contiguous_view(p, t, Device{}, int(shape.size()), shape.data());
  return make_view(p, t, Device{}, int(shape.size()), shape.data(), stride.data());
}

#ifdef MMFUSE_WITH_CUDA
inline bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define MMFUSE_TEST_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// A device copy of a host vector; freed on destruction.
template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(1, n) * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // upload and poison run on the legacy default stream, which does not order work against the
  // tests' non-blocking streams (and cudaMemset, or a copy from pageable memory, may return before
  // the device has finished it): both wait for the device, so that no kernel under test races them.
  void upload(const std::vector<T>& h) {
    if (cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy H2D");
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("cudaDeviceSynchronize after an upload");
  }
  void poison() {
    if (cudaMemset(ptr, 0xFF, n * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMemset");
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("cudaDeviceSynchronize after a poison");
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    if (cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy D2H");
    return h;
  }
};

// A non-blocking stream for the life of the object (the ops under test never use the default stream).
struct Stream {
  cudaStream_t s = nullptr;
  Stream() {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) throw std::runtime_error("stream");
  }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// cos/sin of n fp32 angles with the device's sincosf (tests/cpp/cuda_helpers.cu); synchronizes.
void device_sincosf(const float* angles, float* cos_out, float* sin_out, int64_t n);

inline TensorView device_view(void* p, DType t, std::vector<int64_t> shape, std::vector<int64_t> stride = {}) {
  TensorView v = host_view(p, t, shape, stride);
  v.device = Device{DeviceType::kCUDA, 0};
  return v;
}
#endif

// Sets a path override (common/overrides.h) for the life of the object, then back to auto.
class ScopedOverride {
 public:
  ScopedOverride(const char* name, const char* value) : name_(name) { set_path_override(name, value); }
  ~ScopedOverride() { set_path_override(name_, "auto"); }
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  const char* name_;
};

}  // namespace mmfuse::test
