// Device pieces shared by the rms_norm kernels (src/cuda/rms_norm/*.cu): the grouping's row map and a
// block-wide sum. Internal to each translation unit that includes it.
#pragma once

#include <cuda_runtime.h>

#include "backends/rms_norm.h"
#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/device_util.cuh"
#include "cuda/numerics.cuh"
#include "cuda/rms_norm/path.h"

namespace mmfuse {
namespace detail {
namespace {

using cuda::compute_type;
using cuda::device_type;
using cuda::Vec;

// RmsNormGrouping's row map on the device: the row of a grouped tensor that holds token t.
struct Groups {
  int64_t L, S, B;  // L = 0: identity
  __device__ __forceinline__ int64_t row(int64_t t, bool grouped) const {
    if (!grouped || L == 0) return t;
    const int64_t b = t / L, l = t - b * L;
    return l < S ? b * S + l : B * S + b * (L - S) + (l - S);
  }
};

inline Groups groups_of(const RmsNormGrouping& g, int64_t T) {
  return g.seq_len > 0 ? Groups{g.seq_len, g.split, T / g.seq_len} : Groups{0, 0, 0};
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), in every thread; `red`
// is 32 words of shared memory, free again when this returns.
template <class C>
__device__ __forceinline__ C block_sum(C v, C* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  C s = lane < warps ? red[lane] : C(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  __syncthreads();  // red may be written again by the next call
  return s;
}

// Rows of a [T, H] view of S as 16-byte (or narrower) vectors: row r, vector c.
template <class W>
struct Rows {
  const char* p;
  int64_t stride_bytes;
  __device__ __forceinline__ const W* row(int64_t r) const {
    return reinterpret_cast<const W*>(p + r * stride_bytes);
  }
};
template <class W>
struct OutRows {
  char* p;
  int64_t stride_bytes;
  __device__ __forceinline__ W* row(int64_t r) const { return reinterpret_cast<W*>(p + r * stride_bytes); }
};

template <class W>
inline Rows<W> rows_of(const TensorView& v) {
  return {static_cast<const char*>(v.data), v.stride[0] * int64_t(dtype_size(v.dtype))};
}
template <class W>
inline OutRows<W> out_rows_of(const TensorView& v) {
  return {static_cast<char*>(v.data), v.stride[0] * int64_t(dtype_size(v.dtype))};
}

// Calls f(integral_constant<nv>) for the vectors a thread of row_shape (1, 2, 4, 8; 0: streaming).
template <class F>
void dispatch_nv(int nv, F&& f) {
  switch (nv) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

}  // namespace
}  // namespace detail
}  // namespace mmfuse
