// CUDA backend of linear_cross_entropy's logits gradient, fp32 math (logits read as fp32, bf16 or
// fp16), the gradient rounded once. Two kernels (path.h chooses):
// - two-pass: a block a row; pass 1 reads the row for its running max and sum of exponentials (and
//   the sum of the logits for label smoothing), pass 2 reads it again and writes the gradient;
//   4-element loads where the rows allow;
// - one-read (sm_90): a thread-block cluster a row, each block's slice bulk-copied into its shared
//   memory once; the blocks' statistics merged through distributed shared memory, the gradient
//   written from shared memory: a read and a write of the logits, where the two-pass kernel's second
//   read of a large row comes from memory again.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>

#include "backends/linear_cross_entropy.h"
#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "common/overrides.h"
#include "cuda/device_util.cuh"
#include "cuda/linear_cross_entropy/path.h"
#include "cuda/numerics.cuh"
#include "cuda/tma.cuh"

namespace mmfuse {
namespace detail {
namespace {

using cuda::device_type;
using cuda::Vec;
using lce::kThreads;

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

__device__ __forceinline__ float softcap_of(float v, float cap) {
  return cap > 0.0f ? __fmul_rn(cap, tanhf(__fdiv_rn(v, cap))) : v;
}

// A vector of a row's logits into a thread's running statistics.
template <class ZT, int VEC>
__device__ __forceinline__ void add_stats(Stats& st, const Vec<ZT, VEC>& w, float cap) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float v = softcap_of(cuda::dload(w.v[e]), cap);
    if (v > st.m) {
      st.s = (st.m == -INFINITY ? 0.0f : st.s * expf(st.m - v)) + 1.0f;
      st.m = v;
    } else {
      st.s += expf(v - st.m);  // NaN v (or m) makes s NaN: the row's loss and gradient are NaN
    }
    st.zsum += v;
  }
}

__device__ __forceinline__ float row_loss(const Stats& st, float lse, float zy, int64_t V, const LceParams& p) {
  const float eps = p.label_smoothing;
  return (1.0f - eps) * (lse - zy) + eps * (lse - st.zsum / float(V)) + p.z_loss * lse * lse;
}

// The gradient of a vector of logits starting at column `col`, scaled by the row's `rs`.
template <class D, class ZT, int VEC>
__device__ __forceinline__ Vec<D, VEC> grad_vec(const Vec<ZT, VEC>& w, int64_t col, int64_t y, float lse, float k1,
                                                float k0, float rs, const LceParams& p) {
  const float cap = p.softcap;
  Vec<D, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float v = softcap_of(cuda::dload(w.v[e]), cap);
    float d = expf(v - lse) * k1 - k0 - (col + e == y ? 1.0f - p.label_smoothing : 0.0f);
    if (cap > 0.0f) d *= 1.0f - (v / cap) * (v / cap);
    o.v[e] = cuda::dstore<D>(d * rs);
  }
  return o;
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
  const float eps = p.label_smoothing;
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
      MMFUSE_DEVICE_FAIL("linear_cross_entropy_logits_grad: labels[%lld] = %lld: expected a class in [0, %lld) "
                         "or ignore_index %lld",
                         (long long)r, (long long)y, (long long)V, (long long)p.ignore_index);
    return;
  }
  Stats st{-INFINITY, 0.0f, 0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) add_stats(st, reinterpret_cast<const ZW*>(zr)[c], p.softcap);
  st = block_stats(st, red);
  const float lse = st.m + logf(st.s);
  if (threadIdx.x == 0) loss[r] = row_loss(st, lse, softcap_of(cuda::dload(zr[y]), p.softcap), V, p);
  if (!g) return;
  const float k1 = 1.0f + 2.0f * p.z_loss * lse, k0 = eps / float(V), rs = row_scale[r];
  for (int64_t c = threadIdx.x; c < nv; c += kThreads)
    reinterpret_cast<GW*>(g + r * gs)[c] =
        grad_vec<D>(reinterpret_cast<const ZW*>(zr)[c], c * VEC, y, lse, k1, k0, rs, p);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace cg = cooperative_groups;
#endif

// The one-read kernel: cluster (launch attribute) blocks a row, block `rank` holding logits
// [rank * slice, min((rank + 1) * slice, V)) in shared memory. The host guarantees 16-byte aligned
// rows and slices (VEC = 16 / sizeof(ZT)) and g rows aligned to its vector.
template <class D, class ZT, int VEC>
__global__ void __launch_bounds__(kThreads)
    lce_logits_grad_cluster_kernel(const ZT* __restrict__ z, int64_t zs, const int64_t* __restrict__ labels,
                                   const float* __restrict__ row_scale, float* __restrict__ loss, D* __restrict__ g,
                                   int64_t gs, int64_t V, int64_t slice, LceParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Stats red[kThreads / 32];
  __shared__ Stats mine;  // this block's statistics, read by the cluster's other blocks
  __shared__ __align__(8) uint64_t bar;
  const ZT* zsh = reinterpret_cast<const ZT*>(smem);
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const int64_t r = blockIdx.x / blocks, c0 = int64_t(rank) * slice;
  const int64_t n = c0 < V ? (V - c0 < slice ? V - c0 : slice) : 0;  // this block's logits
  const int64_t nv = n / VEC;
  const ZT* zr = z + r * zs;
  const int64_t y = labels[r];
  const float cap = p.softcap, eps = p.label_smoothing;
  using ZW = Vec<ZT, VEC>;
  using GW = Vec<D, VEC>;
  GW* gr = g ? reinterpret_cast<GW*>(g + r * gs + c0) : nullptr;
  // the row's branches are the same in every block of its cluster: none reaches a cluster barrier alone
  if (y == p.ignore_index) {
    if (rank == 0 && threadIdx.x == 0) loss[r] = 0.0f;
    if (gr) {
      GW zero;
#pragma unroll
      for (int e = 0; e < VEC; ++e) zero.v[e] = cuda::dstore<D>(0.0f);
      for (int64_t c = threadIdx.x; c < nv; c += kThreads) gr[c] = zero;
    }
    return;
  }
  if (y < 0 || y >= V) {
    if (rank == 0 && threadIdx.x == 0)
      MMFUSE_DEVICE_FAIL("linear_cross_entropy_logits_grad: labels[%lld] = %lld: expected a class in [0, %lld) "
                         "or ignore_index %lld",
                         (long long)r, (long long)y, (long long)V, (long long)p.ignore_index);
    return;
  }
  if (threadIdx.x == 0) {
    cuda::mbar_init(&bar, 1);
    cuda::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (n > 0) {
      cuda::mbar_arrive_expect_tx(&bar, unsigned(n * int64_t(sizeof(ZT))));
      cuda::bulk_load(smem, zr + c0, int(n * int64_t(sizeof(ZT))), &bar);
    } else {
      cuda::mbar_arrive(&bar);
    }
  }
  cuda::mbar_wait(&bar, 0);
  Stats st{-INFINITY, 0.0f, 0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) add_stats(st, reinterpret_cast<const ZW*>(zsh)[c], cap);
  st = block_stats(st, red);
  if (threadIdx.x == 0) mine = st;
  cluster.sync();  // every block's statistics written
  Stats row{-INFINITY, 0.0f, 0.0f};
  for (unsigned k = 0; k < blocks; ++k) row = merge(row, *cluster.map_shared_rank(&mine, k));  // rank order
  cluster.sync();  // every block has read the others' before any leaves (its shared memory goes with it)
  const float lse = row.m + logf(row.s);
  if (rank == 0 && threadIdx.x == 0) loss[r] = row_loss(row, lse, softcap_of(cuda::dload(zr[y]), cap), V, p);
  if (!gr) return;
  const float k1 = 1.0f + 2.0f * p.z_loss * lse, k0 = eps / float(V), rs = row_scale[r];
  for (int64_t c = threadIdx.x; c < nv; c += kThreads)
    gr[c] = grad_vec<D>(reinterpret_cast<const ZW*>(zsh)[c], c0 + c * VEC, y, lse, k1, k0, rs, p);
#else
  __trap();  // never launched: the host checks kernel_arch
#endif
}

}  // namespace

void linear_cross_entropy_logits_grad_cuda(const TensorView& z, const TensorView& labels,
                                           const TensorView& row_scale, const LceParams& p, TensorView& loss,
                                           TensorView& g, cudaStream_t stream) {
  const int64_t C = z.shape[0], V = z.shape[1];
  MMFUSE_CHECK(C <= int64_t(0x7fffffff), "linear_cross_entropy_logits_grad: z: at most 2^31 - 1 rows, got ", C);
  const auto force = lce::GradForce(path_override(Knob::kLceGrad));
  auto launch = [&](auto ztag, auto tag) {
    using ZT = typename device_type<typename decltype(ztag)::type>::type;
    using D = typename device_type<typename decltype(tag)::type>::type;
    D* gp = g.defined() ? static_cast<D*>(g.data) : nullptr;
    const int64_t gs = g.defined() ? g.stride[0] : 0;
    // the one-read kernel: 16-byte rows and slices of z (bulk copies), g's rows aligned to its vector
    constexpr int CV = 16 / int(sizeof(ZT));
    auto cluster_kernel = &lce_logits_grad_cluster_kernel<D, ZT, CV>;
    const bool aligned = (V * int64_t(sizeof(ZT))) % 16 == 0 && (z.stride[0] * int64_t(sizeof(ZT))) % 16 == 0 &&
                         cuda::alignment(z.data) >= 16 &&
                         (!gp || (gs % CV == 0 && cuda::alignment(gp) >= CV * sizeof(D)));
    const lce::GradLaunch shape =
        lce::grad_launch(V, int(sizeof(ZT)), aligned,
                         aligned ? cuda::kernel_arch(reinterpret_cast<const void*>(cluster_kernel)) : 0, force);
    if (shape.cluster > 0) {
      const size_t smem = size_t(shape.slice) * sizeof(ZT);
      cuda::cached_fact(std::make_pair(cuda::current_device(), reinterpret_cast<const void*>(cluster_kernel)), [&] {
        MMFUSE_CUDA_CHECK(cudaFuncSetAttribute(cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(lce::kMaxSliceBytes)));
        return 1;
      });
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(unsigned(C * shape.cluster));
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = smem;
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = unsigned(shape.cluster);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, cluster_kernel, static_cast<const ZT*>(z.data), z.stride[0],
                                           static_cast<const int64_t*>(labels.data),
                                           static_cast<const float*>(row_scale.data), static_cast<float*>(loss.data),
                                           gp, gs, V, shape.slice, p));
      MMFUSE_CUDA_CHECK_LAUNCH("lce_logits_grad_cluster_kernel");
      return;
    }
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
