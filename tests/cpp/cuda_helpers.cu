// Device helpers of the C++ tests.
#include <cuda_runtime.h>

#include <stdexcept>

#include "test_util.h"

namespace mmfuse::test {

__global__ void sincosf_kernel(const float* a, float* c, float* s, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) sincosf(a[i], &s[i], &c[i]);
}

void device_sincosf(const float* angles, float* cos_out, float* sin_out, int64_t n) {
  if (n == 0) return;
  sincosf_kernel<<<unsigned((n + 255) / 256), 256>>>(angles, cos_out, sin_out, n);
  if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    throw std::runtime_error("device_sincosf failed");
}

}  // namespace mmfuse::test
