// CUDA backend of SwiGLU on the fused gate/up layout: a thread a 16-byte vector of a row's gate and the
// matching vector of its up (blocks over a row's vectors in x, rows in y), fp32 math, one rounding.
#include <cuda_runtime.h>

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
    for (int e = 0; e < VEC; ++e) {
      const float gv = cuda::dload(g.v[e]), uv = cuda::dload(u.v[e]), dv = cuda::dload(d.v[e]);
      const float sig = sigmoid(gv), s = cuda::mul_rn(gv, sig);
      const float dsilu = cuda::mul_rn(sig, cuda::add_rn(1.0f, cuda::mul_rn(gv, cuda::sub_rn(1.0f, sig))));
      dg.v[e] = cuda::dstore<S>(cuda::mul_rn(cuda::mul_rn(dv, uv), dsilu));
      du.v[e] = cuda::dstore<S>(cuda::mul_rn(dv, s));
      if constexpr (kY) o.v[e] = cuda::dstore<S>(cuda::mul_rn(s, uv));
    }
    W* out = reinterpret_cast<W*>(dgu + t * dgus);
    out[c] = dg;
    out[V + c] = du;
    if constexpr (kY) reinterpret_cast<W*>(y + t * ys)[c] = o;
  }
}

dim3 grid_of(int64_t T, int V) {
  return dim3(unsigned((V + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(T, kMaxRowBlocks)));
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

}  // namespace detail
}  // namespace mmfuse
