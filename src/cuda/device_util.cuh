// Device-side helpers shared by the CUDA backends: reporting bad input found on the device, and a
// 2-D int32 / int64 index view.
#pragma once

#include <cuda_runtime.h>

#include <cassert>
#include <cuda/std/cassert>  // declares __assert_fail under NDEBUG too (MMFUSE_DEVICE_FAIL)
#include <cstdio>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/numerics.cuh"

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

// Device and kernel facts the launches need: queried once per key (device, kernel, ...) and cached
// (host calls, no sync).
template <class Key, class Query>
int cached_fact(const Key& key, Query query) {
  static std::mutex mu;
  static std::map<Key, int> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const int v = query();
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = v;
  return v;
}

// Largest power of two (at most 256) dividing the address (the alignment cuBLASLt may assume).
inline uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t b = 256;
  while (b > 1 && a % b) b /= 2;
  return b;
}

// The widest access (bytes: 16, 8, 4, 2 or 1) dividing the row size and every row's base address and
// stride (bytes).
inline int vec_bytes(int64_t row_bytes, std::initializer_list<std::pair<const void*, int64_t>> rows) {
  for (int b : {16, 8, 4, 2}) {
    bool ok = row_bytes % b == 0;
    for (const auto& [p, stride_bytes] : rows)
      ok = ok && reinterpret_cast<uintptr_t>(p) % b == 0 && stride_bytes % b == 0;
    if (ok) return b;
  }
  return 1;
}

// Calls f(std::integral_constant<int, b>) for an access width b from vec_bytes.
template <class F>
void dispatch_vec(int b, F&& f) {
  switch (b) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// Calls f(TypeTag<D>, std::integral_constant<int, VEC>) for the floating dtype dt (D its device type:
// float, double, __nv_bfloat16, __half) with the widest vector of VEC elements that a row of `cols`
// elements and every given row (base address, stride in bytes) allow. float64 only where kDouble
// (the callers without it reject it first).
template <bool kDouble, class F>
void dispatch_row_vectors(const char* what, DType dt, int64_t cols,
                          std::initializer_list<std::pair<const void*, int64_t>> rows, F&& f) {
  dispatch_floating(dt, what, [&](auto tag) {
    using S = typename std::decay_t<decltype(tag)>::type;
    if constexpr (kDouble || !std::is_same_v<S, double>) {
      using D = typename device_type<S>::type;
      const int b = std::max<int>(vec_bytes(cols * int64_t(sizeof(S)), rows), int(sizeof(S)));
      dispatch_vec(b, [&](auto bc) {
        constexpr int VEC = decltype(bc)::value / int(sizeof(S));
        if constexpr (VEC >= 1) f(TypeTag<D>{}, std::integral_constant<int, VEC>{});
      });
    }
  });
}

inline int current_device() {
  int dev = 0;
  MMFUSE_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

// Multiprocessors of the current device.
inline int sm_count() {
  const int dev = current_device();
  return cached_fact(dev, [&] {
    int n = 0;
    MMFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  });
}

// Blocks of `kernel` (`threads` threads, `smem` dynamic bytes) resident at once on the current device.
inline int resident_blocks(const void* kernel, int threads, size_t smem) {
  return cached_fact(std::make_tuple(current_device(), kernel, threads, smem), [&] {
    int per_sm = 0;
    MMFUSE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    return per_sm * sm_count();
  });
}

// __CUDA_ARCH__ / 10 of the code of `kernel` that runs on the current device (its PTX architecture:
// also right when the driver compiles older PTX for a newer device), for kernels whose body exists
// only from some architecture on.
inline int kernel_arch(const void* kernel) {
  return cached_fact(std::make_pair(current_device(), kernel), [&] {
    cudaFuncAttributes attr{};
    MMFUSE_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    return attr.ptxVersion;
  });
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
