// CUDA forward of residual add + RMSNorm: a block a row (the grouping's row map on the reads and the
// writes), the row held in registers as 16-byte vectors where it fits (row_shape in path.h), else
// streamed twice. fp32 statistics, HF's roundings: h in the dtype, then round(w * round(h * rstd)).
#include "cuda/rms_norm/common.cuh"

namespace mmfuse {
namespace detail {
namespace {

// Token t's h (x[gx(t)] + residual[t], rounded) as vector c.
template <class S, int VEC, bool kRes>
__device__ __forceinline__ Vec<S, VEC> h_vec(const Vec<S, VEC>* xr, const Vec<S, VEC>* rr, int c) {
  Vec<S, VEC> a = xr[c];
  if constexpr (kRes) {
    const Vec<S, VEC> b = rr[c];
#pragma unroll
    for (int e = 0; e < VEC; ++e) a.v[e] = cuda::dstore<S>(cuda::add_rn(cuda::dload(a.v[e]), cuda::dload(b.v[e])));
  }
  return a;
}

template <class S, int VEC>
__device__ __forceinline__ float sum_sq(const Vec<S, VEC>& h) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < VEC; ++e) s = cuda::add_rn(s, cuda::mul_rn(cuda::dload(h.v[e]), cuda::dload(h.v[e])));
  return s;
}

// round(w * round(h * r)) of vector c
template <class S, int VEC>
__device__ __forceinline__ Vec<S, VEC> normed(const Vec<S, VEC>& h, const Vec<S, VEC>& w, float r) {
  Vec<S, VEC> y;
#pragma unroll
  for (int e = 0; e < VEC; ++e)
    y.v[e] = cuda::dstore<S>(cuda::mul_rn(cuda::dload(w.v[e]), cuda::dround<S>(cuda::mul_rn(cuda::dload(h.v[e]), r))));
  return y;
}

// A block a row (rows blockIdx.x, + gridDim.x, ...): NV vectors a thread in registers, or (NV = 0) two
// passes over the row.
template <class S, int VEC, int NV, bool kRes, bool kWriteH>
__global__ void __launch_bounds__(rms_norm::kMaxThreads)
    rms_norm_fwd_kernel(Rows<Vec<S, VEC>> x, Rows<Vec<S, VEC>> res, const Vec<S, VEC>* __restrict__ w,
                        OutRows<Vec<S, VEC>> out, OutRows<Vec<S, VEC>> hout, float* __restrict__ rstd, int64_t T, int V,
                        float hf, float eps, Groups g, bool xg, bool og) {
  using W = Vec<S, VEC>;
  __shared__ float red[32];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const W* xr = x.row(g.row(t, xg));
    const W* rr = kRes ? res.row(t) : nullptr;
    W* orow = out.row(g.row(t, og));
    float ss = 0.0f;
    if constexpr (NV > 0) {
      W hv[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < V) {
          hv[i] = h_vec<S, VEC, kRes>(xr, rr, c);
          ss += sum_sq(hv[i]);
        }
      }
      const float r = 1.0f / sqrtf(block_sum(ss, red) / hf + eps);
      if (threadIdx.x == 0) rstd[t] = r;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < V) {
          if constexpr (kWriteH) hout.row(t)[c] = hv[i];
          orow[c] = normed(hv[i], w[c], r);
        }
      }
    } else {
      for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const W h = h_vec<S, VEC, kRes>(xr, rr, c);
        ss += sum_sq(h);
        if constexpr (kWriteH) hout.row(t)[c] = h;
      }
      const float r = 1.0f / sqrtf(block_sum(ss, red) / hf + eps);
      if (threadIdx.x == 0) rstd[t] = r;
      for (int c = threadIdx.x; c < V; c += blockDim.x) orow[c] = normed(h_vec<S, VEC, kRes>(xr, rr, c), w[c], r);
    }
  }
}

}  // namespace

void rms_norm_cuda(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
                   const RmsNormGrouping& g, TensorView& out, TensorView& h_out, TensorView& rstd,
                   cudaStream_t stream) {
  const int64_t T = x.shape[0], H = x.shape[1], es = int64_t(dtype_size(x.dtype));
  const bool has_res = residual.defined(), write_h = has_res || g.x_grouped;
  std::initializer_list<std::pair<const void*, int64_t>> rows = {
      {x.data, x.stride[0] * es}, {out.data, out.stride[0] * es}, {weight.data, 0},
      {has_res ? residual.data : nullptr, has_res ? residual.stride[0] * es : 0},
      {write_h ? h_out.data : nullptr, write_h ? h_out.stride[0] * es : 0}};
  cuda::dispatch_row_vectors<false>("rms_norm: x", x.dtype, H, rows, [&](auto tag, auto vc) {
    using S = typename decltype(tag)::type;
    constexpr int VEC = decltype(vc)::value;
    using W = Vec<S, VEC>;
    const int V = int(H / VEC);
    const rms_norm::RowShape shape = rms_norm::row_shape(V);
    const unsigned grid = unsigned(std::min<int64_t>(T, int64_t(1) << 30));
    dispatch_nv(shape.vectors_per_thread, [&](auto nvc) {
      constexpr int NV = decltype(nvc)::value;
      auto go = [&](auto kres, auto kwh) {
        constexpr bool R = decltype(kres)::value, WH = decltype(kwh)::value;
        rms_norm_fwd_kernel<S, VEC, NV, R, WH><<<grid, shape.threads, 0, stream>>>(
            rows_of<W>(x), has_res ? rows_of<W>(residual) : Rows<W>{nullptr, 0},
            static_cast<const W*>(weight.data), out_rows_of<W>(out), write_h ? out_rows_of<W>(h_out) : OutRows<W>{nullptr, 0},
            static_cast<float*>(rstd.data), T, V, float(H), float(eps), groups_of(g, T), g.x_grouped,
            g.out_grouped);
      };
      if (has_res)
        go(std::true_type{}, std::true_type{});
      else if (write_h)
        go(std::false_type{}, std::true_type{});
      else
        go(std::false_type{}, std::false_type{});
      MMFUSE_CUDA_CHECK_LAUNCH("rms_norm_fwd_kernel");
    });
  });
}

}  // namespace detail
}  // namespace mmfuse
