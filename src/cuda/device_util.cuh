// Device-side helpers shared by the CUDA backends: reporting bad input found on the device, and a
// 2-D int32 / int64 index view.
#pragma once

#include <cuda_runtime.h>

#include <cassert>
#include <cstdio>
#include <map>
#include <mutex>

#include "common/cuda_check.h"

#include "mmfuse/common.h"

// Bad input found on the device: print what is wrong, then stop the kernel with a device-side
// assertion (the CUDA error surfaces at the next synchronizing call, as PyTorch's own index checks).
#define MMFUSE_DEVICE_FAIL(fmt, ...)                                                        \
  do {                                                                                      \
    printf("mmfuse." fmt "\n", __VA_ARGS__);                                                \
    __assert_fail("mmfuse: invalid input (see the message above)", __FILE__, __LINE__, __func__); \
  } while (0)

namespace mmfuse {
namespace cuda {

struct IndexRef {  // 2-D int32 / int64 view
  const void* p = nullptr;
  int64_t s0 = 0, s1 = 0;
  bool i64 = true;
  __device__ int64_t operator()(int64_t i, int64_t j) const {
    const int64_t o = i * s0 + j * s1;
    return i64 ? static_cast<const int64_t*>(p)[o] : int64_t(static_cast<const int32_t*>(p)[o]);
  }
};

// Per-device facts the launches need, queried once per device (host calls, no sync):
// the SM count of the current device.
inline int sm_count() {
  static std::mutex mu;
  static std::map<int, int> sms;
  int dev = 0;
  MMFUSE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = sms.find(dev);
  if (it == sms.end()) {
    int n = 0;
    MMFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    it = sms.emplace(dev, n).first;
  }
  return it->second;
}

inline IndexRef index_ref(const TensorView& v) {
  IndexRef r;
  if (!v.defined()) return r;
  r.p = v.data;
  r.s0 = v.stride[0];
  r.s1 = v.ndim > 1 ? v.stride[1] : 0;
  r.i64 = v.dtype == DType::kInt64;
  return r;
}

}  // namespace cuda
}  // namespace mmfuse
