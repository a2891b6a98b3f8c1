// CUDA backend of linear_cross_entropy's logits gradient: a block a row; pass 1 reads the row for its
// running max and sum of exponentials (and the sum of the logits for label smoothing), pass 2 reads it
// again and writes the gradient, rounded once. fp32 math (logits read as fp32, bf16 or fp16); 4-element
// loads where the rows allow.
#include <cuda_runtime.h>

#include <cmath>

#include "backends/linear_cross_entropy.h"
#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/device_util.cuh"
#include "cuda/numerics.cuh"

namespace mmfuse {
namespace detail {
namespace {

using cuda::device_type;
using cuda::Vec;

constexpr int kThreads = 512;

struct Stats {
  float m, s, zsum;  // running max, sum of exp(v - m), sum of v
};

__device__ __forceinline__ Stats merge(const Stats& a, const Stats& b) {
  const float m = fmaxf(a.m, b.m);
  // a side with no values (m = -inf) adds nothing; exp(-inf - -inf) would be NaN
  const float sa = a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m), sb = b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m);
  return {m, sa + sb, a.zsum + b.zsum};
}

__device__ __forceinline__ Stats shfl(const Stats& v, int o) {
  return {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o),
          __shfl_xor_sync(0xffffffffu, v.zsum, o)};
}

// The block's merged stats, in every thread.
__device__ Stats block_stats(Stats v, Stats* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = merge(v, shfl(v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? red[lane] : Stats{-INFINITY, 0.0f, 0.0f};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = merge(v, shfl(v, o));
  return v;
}

template <class D, class ZT, int VEC>
__global__ void __launch_bounds__(kThreads)
    lce_logits_grad_kernel(const ZT* __restrict__ z, int64_t zs, const int64_t* __restrict__ labels,
                           const float* __restrict__ row_scale, float* __restrict__ loss, D* __restrict__ g, int64_t gs,
                           int64_t V, LceParams p) {
  __shared__ Stats red[kThreads / 32];
  const int64_t r = blockIdx.x;
  const ZT* zr = z + r * zs;
  const int64_t y = labels[r];
  const float cap = p.softcap, eps = p.label_smoothing;
  auto soft = [&](float v) { return cap > 0.0f ? __fmul_rn(cap, tanhf(__fdiv_rn(v, cap))) : v; };
  const int64_t nv = V / VEC;
  using ZW = Vec<ZT, VEC>;
  using GW = Vec<D, VEC>;
  if (y == p.ignore_index) {
    if (threadIdx.x == 0) loss[r] = 0.0f;
    if (g) {
      GW zero;
#pragma unroll
      for (int e = 0; e < VEC; ++e) zero.v[e] = cuda::dstore<D>(0.0f);
      for (int64_t c = threadIdx.x; c < nv; c += kThreads) reinterpret_cast<GW*>(g + r * gs)[c] = zero;
    }
    return;
  }
  if (y < 0 || y >= V) {
    if (threadIdx.x == 0)
      MMFUSE_DEVICE_FAIL("linear_cross_entropy: labels[%lld] = %lld: expected a class in [0, %lld) or ignore_index %lld",
                         (long long)r, (long long)y, (long long)V, (long long)p.ignore_index);
    return;
  }
  Stats st{-INFINITY, 0.0f, 0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) {
    const ZW w = reinterpret_cast<const ZW*>(zr)[c];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float v = soft(cuda::dload(w.v[e]));
      if (v > st.m) {
        st.s = (st.m == -INFINITY ? 0.0f : st.s * expf(st.m - v)) + 1.0f;
        st.m = v;
      } else {
        st.s += expf(v - st.m);  // NaN v (or m) makes s NaN: the row's loss and gradient are NaN
      }
      st.zsum += v;
    }
  }
  st = block_stats(st, red);
  const float lse = st.m + logf(st.s);
  if (threadIdx.x == 0) {
    const float zy = soft(cuda::dload(zr[y]));
    loss[r] = (1.0f - eps) * (lse - zy) + eps * (lse - st.zsum / float(V)) + p.z_loss * lse * lse;
  }
  if (!g) return;
  const float k1 = 1.0f + 2.0f * p.z_loss * lse, k0 = eps / float(V), rs = row_scale[r];
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) {
    const ZW w = reinterpret_cast<const ZW*>(zr)[c];
    GW o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float v = soft(cuda::dload(w.v[e]));
      float d = expf(v - lse) * k1 - k0 - (c * VEC + e == y ? 1.0f - eps : 0.0f);
      if (cap > 0.0f) d *= 1.0f - (v / cap) * (v / cap);
      o.v[e] = cuda::dstore<D>(d * rs);
    }
    reinterpret_cast<GW*>(g + r * gs)[c] = o;
  }
}

}  // namespace

void linear_cross_entropy_logits_grad_cuda(const TensorView& z, const TensorView& labels,
                                           const TensorView& row_scale, const LceParams& p, TensorView& loss,
                                           TensorView& g, cudaStream_t stream) {
  const int64_t C = z.shape[0], V = z.shape[1];
  MMFUSE_CHECK(C <= int64_t(0x7fffffff), "linear_cross_entropy_logits_grad: z: at most 2^31 - 1 rows, got ", C);
  auto launch = [&](auto ztag, auto tag) {
    using ZT = typename device_type<typename decltype(ztag)::type>::type;
    using D = typename device_type<typename decltype(tag)::type>::type;
    D* gp = g.defined() ? static_cast<D*>(g.data) : nullptr;
    const int64_t gs = g.defined() ? g.stride[0] : 0;
    // 4 logits a load where every row of z and g starts 4-element aligned
    const bool vec4 = V % 4 == 0 && z.stride[0] % 4 == 0 && cuda::alignment(z.data) >= 4 * sizeof(ZT) &&
                      (!gp || (gs % 4 == 0 && cuda::alignment(gp) >= 4 * sizeof(D)));
    auto go = [&](auto vc) {
      constexpr int VEC = decltype(vc)::value;
      lce_logits_grad_kernel<D, ZT, VEC><<<unsigned(C), kThreads, 0, stream>>>(
          static_cast<const ZT*>(z.data), z.stride[0], static_cast<const int64_t*>(labels.data),
          static_cast<const float*>(row_scale.data), static_cast<float*>(loss.data), gp, gs, V, p);
    };
    if (vec4)
      go(std::integral_constant<int, 4>{});
    else
      go(std::integral_constant<int, 1>{});
    MMFUSE_CUDA_CHECK_LAUNCH("lce_logits_grad_kernel");
  };
  // z fp32 with any g, or z and g of one 16-bit dtype (the entry point checks)
  dispatch_floating(z.dtype, "linear_cross_entropy_logits_grad: z", [&](auto ztag) {
    using Z = typename decltype(ztag)::type;
    if constexpr (std::is_same_v<Z, float>) {
      if (!g.defined()) return launch(ztag, TypeTag<float>{});
      dispatch_floating(g.dtype, "linear_cross_entropy_logits_grad: g", [&](auto tag) {
        if constexpr (!std::is_same_v<typename decltype(tag)::type, double>) launch(ztag, tag);
      });
    } else if constexpr (!std::is_same_v<Z, double>) {
      launch(ztag, ztag);  // g absent or of z's dtype
    }
  });
}

}  // namespace detail
}  // namespace mmfuse
