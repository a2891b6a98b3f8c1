// CUDA backend of SwiGLU on the fused gate/up layout: a thread a 16-byte vector of a row's gate and the
// matching vector of its up (blocks over a row's vectors in x, rows in y), fp32 math, one rounding.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "backends/swiglu.h"
#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/device_util.cuh"
#include "cuda/numerics.cuh"
#include "cuda/swiglu_value.cuh"

namespace mmfuse {
namespace detail {
namespace {

using cuda::device_type;
using cuda::Vec;

constexpr int kThreads = 256;
constexpr int64_t kMaxRowBlocks = 65535;  // grid.y; rows beyond it are walked

using cuda::sigmoid;

template <class S, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const char* __restrict__ gu, int64_t gus, char* __restrict__ y,
                                                          int64_t ys, int64_t T, int V) {
  using W = Vec<S, VEC>;
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= V) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const W* row = reinterpret_cast<const W*>(gu + t * gus);
    const W g = row[c], u = row[V + c];
    W o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = cuda::swiglu_value(g.v[e], u.v[e]);
    reinterpret_cast<W*>(y + t * ys)[c] = o;
  }
}

using cuda::swiglu_grad_value;
using cuda::swiglu_unpack;

// No __restrict__: d_gate_up may be gate_up and y may be dy (in place); a thread loads its three
// vectors before it stores any.
template <class S, int VEC, bool kY>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const char* dy, int64_t dys, const char* gu, int64_t gus, char* dgu, int64_t dgus, char* y,
                      int64_t ys, int64_t T, int V) {
  using W = Vec<S, VEC>;
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= V) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const W* row = reinterpret_cast<const W*>(gu + t * gus);
    const W g = row[c], u = row[V + c], d = reinterpret_cast<const W*>(dy + t * dys)[c];
    W dg, du, o;
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      swiglu_grad_value<S, kY>(cuda::dload(g.v[e]), cuda::dload(u.v[e]), cuda::dload(d.v[e]), dg.v[e], du.v[e], o.v[e]);
    W* out = reinterpret_cast<W*>(dgu + t * dgus);
    out[c] = dg;
    out[V + c] = du;
    if constexpr (kY) reinterpret_cast<W*>(y + t * ys)[c] = o;
  }
}

// swiglu_pack_fp8: a tile (128 columns of a row) to 16 consecutive threads, 8 values a thread; the
// tile's amax by shuffles within those 16 lanes. kVec: one access for a thread's 8 values (the row, its
// base and stride allow it).
constexpr int kPackLanes = int(kSwigluPackTile) / 8;

template <class S, bool kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_pack_fp8_kernel(const char* __restrict__ gu, int64_t gus, uint8_t* __restrict__ q, int64_t qs,
                           float* __restrict__ si, int64_t sis, int64_t T, int64_t C2, int64_t tiles) {
  const int64_t tile = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kPackLanes;
  const int lane = int(threadIdx.x % kPackLanes);
  const bool live = tile < T * tiles;
  const int64_t t = live ? tile / tiles : 0, j0 = (live ? tile % tiles : 0) * kSwigluPackTile + lane * 8;
  const S* row = reinterpret_cast<const S*>(gu + t * gus);
  float v[8];
  if constexpr (kVec) {
    const cuda::Vec<S, 8> x = live && j0 < C2 ? reinterpret_cast<const cuda::Vec<S, 8>*>(row + j0)[0]
                                               : cuda::Vec<S, 8>{};
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = cuda::dload(x.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = live && j0 + e < C2 ? cuda::dload(row[j0 + e]) : 0.0f;
  }
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = fmaxf(amax, cuda::fp8_finite_abs(v[e]));
#pragma unroll
  for (int o = kPackLanes / 2; o >= 1; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!live) return;  // after the shuffles, in which every lane of the warp takes part
  const int k = swiglu_pack_exponent(__float_as_uint(amax));
  const float scale = __int_as_float((127 + k) << 23);  // 2^k, k in [-126, 126]: a normal float
  uint8_t b[8];
#pragma unroll
  for (int p = 0; p < 8; p += 2) {
    const __nv_fp8x2_storage_t w = __nv_cvt_float2_to_fp8x2(
        make_float2(cuda::fp8_scaled(v[p], scale), cuda::fp8_scaled(v[p + 1], scale)), __NV_SATFINITE, __NV_E4M3);
    b[p] = uint8_t(w & 0xff);
    b[p + 1] = uint8_t(w >> 8);
  }
  uint8_t* qr = q + t * qs;
  if constexpr (kVec) {
    if (j0 < C2) {
      cuda::Vec<uint8_t, 8> o;
#pragma unroll
      for (int e = 0; e < 8; ++e) o.v[e] = b[e];
      reinterpret_cast<cuda::Vec<uint8_t, 8>*>(qr + j0)[0] = o;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (j0 + e < C2) qr[j0 + e] = b[e];
  }
  if (lane == 0) si[t * sis + j0 / kSwigluPackTile] = __int_as_float((127 - k) << 23);
}

// swiglu_backward_fp8: as swiglu_bwd_kernel, gate and up unpacked from q; a thread 8 columns (one
// tile's scale for each half: the columns stay in one tile when kVec, I a multiple of 8). No
// __restrict__ on dy and y: y may be dy.
template <class S, bool kVec, bool kY>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_fp8_kernel(const char* dy, int64_t dys, const uint8_t* __restrict__ q, int64_t qs,
                          const float* __restrict__ si, int64_t sis, char* __restrict__ dgu, int64_t dgus, char* y,
                          int64_t ys, int64_t T, int64_t I) {
  const int64_t j0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 8;
  if (j0 >= I) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    const uint8_t* qr = q + t * qs;
    const float* sr = si + t * sis;
    const S* d = reinterpret_cast<const S*>(dy + t * dys);
    S* dg = reinterpret_cast<S*>(dgu + t * dgus);
    S* yr = reinterpret_cast<S*>(y + t * ys);
    if constexpr (kVec) {
      const cuda::Vec<uint8_t, 8> gq = reinterpret_cast<const cuda::Vec<uint8_t, 8>*>(qr + j0)[0];
      const cuda::Vec<uint8_t, 8> uq = reinterpret_cast<const cuda::Vec<uint8_t, 8>*>(qr + I + j0)[0];
      const cuda::Vec<S, 8> dv = reinterpret_cast<const cuda::Vec<S, 8>*>(d + j0)[0];
      const float gs = sr[j0 / kSwigluPackTile], us = sr[(I + j0) / kSwigluPackTile];
      cuda::Vec<S, 8> og, ou, oy;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        swiglu_grad_value<S, kY>(swiglu_unpack(gq.v[e], gs), swiglu_unpack(uq.v[e], us), cuda::dload(dv.v[e]), og.v[e], ou.v[e], oy.v[e]);
      reinterpret_cast<cuda::Vec<S, 8>*>(dg + j0)[0] = og;
      reinterpret_cast<cuda::Vec<S, 8>*>(dg + I + j0)[0] = ou;
      if constexpr (kY) reinterpret_cast<cuda::Vec<S, 8>*>(yr + j0)[0] = oy;
    } else {
      for (int64_t j = j0; j < I && j < j0 + 8; ++j) {
        S og, ou, oy;
        swiglu_grad_value<S, kY>(swiglu_unpack(qr[j], sr[j / kSwigluPackTile]), swiglu_unpack(qr[I + j], sr[(I + j) / kSwigluPackTile]),
                          cuda::dload(d[j]), og, ou, oy);
        dg[j] = og;
        dg[I + j] = ou;
        if constexpr (kY) yr[j] = oy;
      }
    }
  }
}

dim3 grid_of(int64_t T, int V) {
  return dim3(unsigned((V + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(T, kMaxRowBlocks)));
}

// Whether every (base, stride in bytes) given allows accesses of `bytes`.
bool aligned_rows(int64_t bytes, std::initializer_list<std::pair<const void*, int64_t>> rows) {
  for (const auto& [p, stride] : rows)
    if (reinterpret_cast<uintptr_t>(p) % bytes || stride % bytes) return false;
  return true;
}

}  // namespace

void swiglu_cuda(const TensorView& gate_up, TensorView& out, cudaStream_t stream) {
  const int64_t T = gate_up.shape[0], I = gate_up.shape[1] / 2, es = int64_t(dtype_size(gate_up.dtype));
  cuda::dispatch_row_vectors<false>("swiglu: gate_up", gate_up.dtype, I, {{gate_up.data, gate_up.stride[0] * es}, {out.data, out.stride[0] * es}},
                [&](auto tag, auto vc) {
                  using S = typename decltype(tag)::type;
                  constexpr int VEC = decltype(vc)::value;
                  const int V = int(I / VEC);
                  swiglu_kernel<S, VEC><<<grid_of(T, V), kThreads, 0, stream>>>(
                      static_cast<const char*>(gate_up.data), gate_up.stride[0] * es, static_cast<char*>(out.data),
                      out.stride[0] * es, T, V);
                  MMFUSE_CUDA_CHECK_LAUNCH("swiglu_kernel");
                });
}

void swiglu_backward_cuda(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y,
                          cudaStream_t stream) {
  const int64_t T = gate_up.shape[0], I = gate_up.shape[1] / 2, es = int64_t(dtype_size(gate_up.dtype));
  const bool with_y = y.defined();
  cuda::dispatch_row_vectors<false>("swiglu_backward: gate_up", gate_up.dtype, I,
                {{gate_up.data, gate_up.stride[0] * es}, {dy.data, dy.stride[0] * es},
                 {d_gate_up.data, d_gate_up.stride[0] * es}, {with_y ? y.data : nullptr, with_y ? y.stride[0] * es : 0}},
                [&](auto tag, auto vc) {
                  using S = typename decltype(tag)::type;
                  constexpr int VEC = decltype(vc)::value;
                  const int V = int(I / VEC);
                  auto kernel = with_y ? &swiglu_bwd_kernel<S, VEC, true> : &swiglu_bwd_kernel<S, VEC, false>;
                  kernel<<<grid_of(T, V), kThreads, 0, stream>>>(
                      static_cast<const char*>(dy.data), dy.stride[0] * es, static_cast<const char*>(gate_up.data),
                      gate_up.stride[0] * es, static_cast<char*>(d_gate_up.data), d_gate_up.stride[0] * es,
                      with_y ? static_cast<char*>(y.data) : nullptr, with_y ? y.stride[0] * es : 0, T, V);
                  MMFUSE_CUDA_CHECK_LAUNCH("swiglu_bwd_kernel");
                });
}

void swiglu_pack_fp8_cuda(const TensorView& gate_up, TensorView& q, TensorView& scale_inv, cudaStream_t stream) {
  const int64_t T = gate_up.shape[0], C2 = gate_up.shape[1], tiles = scale_inv.shape[1];
  const int64_t es = int64_t(dtype_size(gate_up.dtype));
  const bool vec = C2 % 8 == 0 && aligned_rows(8 * es, {{gate_up.data, gate_up.stride[0] * es}}) &&
                   aligned_rows(8, {{q.data, q.stride[0]}});
  const int64_t threads = T * tiles * kPackLanes;
  const dim3 grid(unsigned((threads + kThreads - 1) / kThreads));
  dispatch_floating(gate_up.dtype, "swiglu_pack_fp8: gate_up", [&](auto tag) {
    using S = typename cuda::device_type<typename decltype(tag)::type>::type;
    if constexpr (!std::is_same_v<S, double>) {
      auto kernel = vec ? &swiglu_pack_fp8_kernel<S, true> : &swiglu_pack_fp8_kernel<S, false>;
      kernel<<<grid, kThreads, 0, stream>>>(static_cast<const char*>(gate_up.data), gate_up.stride[0] * es,
                                            static_cast<uint8_t*>(q.data), q.stride[0],
                                            static_cast<float*>(scale_inv.data), scale_inv.stride[0], T, C2, tiles);
      MMFUSE_CUDA_CHECK_LAUNCH("swiglu_pack_fp8_kernel");
    }
  });
}

void swiglu_backward_fp8_cuda(const TensorView& dy, const TensorView& q, const TensorView& scale_inv,
                              TensorView& d_gate_up, TensorView& y, cudaStream_t stream) {
  const int64_t T = q.shape[0], I = q.shape[1] / 2, es = int64_t(dtype_size(dy.dtype));
  const bool with_y = y.defined();
  const bool vec = I % 8 == 0 &&
                   aligned_rows(8 * es, {{dy.data, dy.stride[0] * es}, {d_gate_up.data, d_gate_up.stride[0] * es},
                                         {with_y ? y.data : nullptr, with_y ? y.stride[0] * es : 0}}) &&
                   aligned_rows(8, {{q.data, q.stride[0]}});
  const dim3 grid = grid_of(T, int((I + 7) / 8));
  dispatch_floating(dy.dtype, "swiglu_backward_fp8: dy", [&](auto tag) {
    using S = typename cuda::device_type<typename decltype(tag)::type>::type;
    if constexpr (!std::is_same_v<S, double>) {
      auto kernel = vec ? (with_y ? &swiglu_bwd_fp8_kernel<S, true, true> : &swiglu_bwd_fp8_kernel<S, true, false>)
                        : (with_y ? &swiglu_bwd_fp8_kernel<S, false, true> : &swiglu_bwd_fp8_kernel<S, false, false>);
      kernel<<<grid, kThreads, 0, stream>>>(
          static_cast<const char*>(dy.data), dy.stride[0] * es, static_cast<const uint8_t*>(q.data), q.stride[0],
          static_cast<const float*>(scale_inv.data), scale_inv.stride[0], static_cast<char*>(d_gate_up.data),
          d_gate_up.stride[0] * es, with_y ? static_cast<char*>(y.data) : nullptr, with_y ? y.stride[0] * es : 0, T,
          I);
      MMFUSE_CUDA_CHECK_LAUNCH("swiglu_bwd_fp8_kernel");
    }
  });
}

}  // namespace detail
}  // namespace mmfuse
