// CUDA backend of fp8_transpose: 64 x 64-byte tiles through shared memory. A thread loads 16 bytes of
// a row of q (4 threads a row: whole 64-byte runs), and after the block's barrier gathers 16 bytes of
// a column (16 rows of q) and stores them as a run of a row of qt.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "cuda/device_util.cuh"
#include "backends/fp8.h"
#include "mmfuse/fp8.h"

namespace mmfuse {
namespace detail {
namespace {

constexpr int kT = 64, kThreads = 256;
constexpr int kWords = kT / 4 + 1;  // a tile row of 16 words and one of padding: fewer bank conflicts

// Tiles t = blockIdx.x, + gridDim.x, ...: tile row t / tiles_c, tile column t % tiles_c. r and c are
// multiples of 16, so a thread's 16-byte run is wholly inside q or wholly outside.
__global__ void __launch_bounds__(kThreads) fp8_transpose_kernel(const uint8_t* __restrict__ q,
                                                                 uint8_t* __restrict__ qt, int64_t r, int64_t c,
                                                                 int64_t tiles_c, int64_t tiles) {
  __shared__ uint32_t tile[kT][kWords];
  const int tr = threadIdx.x / 4, tc = (threadIdx.x % 4) * 16;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kT, c0 = (t % tiles_c) * kT;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r0 + tr < r && c0 + tc < c) v = __ldg(reinterpret_cast<const uint4*>(q + (r0 + tr) * c + c0 + tc));
    __syncthreads();  // the previous tile's reads of the shared tile are done
    tile[tr][tc / 4] = v.x;
    tile[tr][tc / 4 + 1] = v.y;
    tile[tr][tc / 4 + 2] = v.z;
    tile[tr][tc / 4 + 3] = v.w;
    __syncthreads();
    // now: column tr of the tile (a row of qt), rows tc .. tc + 15 of the tile (16 bytes of that row)
    const int shift = 8 * (tr % 4);
    uint32_t o[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t x = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) x |= ((tile[tc + 4 * w + b][tr / 4] >> shift) & 0xffu) << (8 * b);
      o[w] = x;
    }
    if (c0 + tr < c && r0 + tc < r)
      *reinterpret_cast<uint4*>(qt + (c0 + tr) * r + r0 + tc) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void fp8_transpose_cuda(const TensorView& q, TensorView& qt, cudaStream_t stream) {
  const int64_t r = q.shape[0], c = q.shape[1];
  MMFUSE_CHECK(cuda::alignment(q.data) >= 16 && cuda::alignment(qt.data) >= 16,
               "fp8_transpose: q and qt: expected 16-byte aligned data");
  const int64_t tiles_c = cdiv(c, kT), tiles = cdiv(r, kT) * tiles_c;
  const unsigned blocks = unsigned(std::min<int64_t>(tiles, int64_t(cuda::sm_count()) * 16));
  fp8_transpose_kernel<<<blocks, kThreads, 0, stream>>>(q.ptr<uint8_t>(), qt.ptr<uint8_t>(), r, c, tiles_c, tiles);
  MMFUSE_CUDA_CHECK_LAUNCH("fp8_transpose_kernel");
}

}  // namespace detail
}  // namespace mmfuse
