// CUDA backward of residual add + RMSNorm: a fixed set of rows a block (b, b + blocks, ...), the row
// in registers where it fits; dx and dresidual written once, the weight gradient as a per-block
// partial sum (registers, or the block's workspace row) and then summed over the blocks in order by
// a second kernel: no atomics, the same bits on every run.
#include "cuda/rms_norm/common.cuh"

namespace mmfuse {
namespace detail {
namespace {

// One vector of the row: gw = dy * w, xh = h * r; returns sum gw * xh; adds dy * round(xh) to acc.
template <class S, int VEC>
__device__ __forceinline__ float grad_vec(const Vec<S, VEC>& dy, const Vec<S, VEC>& w, const Vec<S, VEC>& h, float r,
                                          float (&gw)[VEC], float (&xh)[VEC], float (&acc)[VEC]) {
  float dot = 0.0f;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float d = cuda::dload(dy.v[e]);
    gw[e] = cuda::mul_rn(d, cuda::dload(w.v[e]));
    xh[e] = cuda::mul_rn(cuda::dload(h.v[e]), r);
    dot = cuda::add_rn(dot, cuda::mul_rn(gw[e], xh[e]));
    acc[e] = cuda::add_rn(acc[e], cuda::mul_rn(d, cuda::dround<S>(xh[e])));
  }
  return dot;
}

// dx = r * (gw - xh * mean) (+ dh), rounded once
template <class S, int VEC, bool kDh>
__device__ __forceinline__ Vec<S, VEC> dx_vec(const float (&gw)[VEC], const float (&xh)[VEC], float r, float mean,
                                              const Vec<S, VEC>* dhr, int c) {
  Vec<S, VEC> o;
  Vec<S, VEC> d;
  if constexpr (kDh) d = dhr[c];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float v = cuda::mul_rn(r, cuda::sub_rn(gw[e], cuda::mul_rn(xh[e], mean)));
    if constexpr (kDh) v = cuda::add_rn(v, cuda::dload(d.v[e]));
    o.v[e] = cuda::dstore<S>(v);
  }
  return o;
}

template <class S, int VEC, int NV, bool kDh, bool kDres>
__global__ void __launch_bounds__(rms_norm::kMaxThreads)
    rms_norm_bwd_kernel(Rows<Vec<S, VEC>> dout, Rows<Vec<S, VEC>> dh, Rows<Vec<S, VEC>> h,
                        const float* __restrict__ rstd, const Vec<S, VEC>* __restrict__ w, OutRows<Vec<S, VEC>> dx,
                        OutRows<Vec<S, VEC>> dres, float* __restrict__ partial, int64_t T, int V, float hf, Groups g,
                        bool xg, bool og) {
  using W = Vec<S, VEC>;
  __shared__ float red[32];
  float* mine = partial + int64_t(blockIdx.x) * V * VEC;  // [H]: this block's weight-gradient sum
  constexpr int kNV = NV > 0 ? NV : 1;
  float acc[kNV][VEC] = {};
  float gw[kNV][VEC], xh[kNV][VEC];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const W* dyr = dout.row(g.row(t, og));
    const W* hr = h.row(t);
    const W* dhr = kDh ? dh.row(t) : nullptr;
    const float r = rstd[t];
    float dot = 0.0f;
    if constexpr (NV > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < V) dot += grad_vec<S, VEC>(dyr[c], w[c], hr[c], r, gw[i], xh[i], acc[i]);
      }
      const float mean = block_sum(dot, red) / hf;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < V) {
          const W o = dx_vec<S, VEC, kDh>(gw[i], xh[i], r, mean, dhr, c);
          dx.row(g.row(t, xg))[c] = o;
          if constexpr (kDres) dres.row(t)[c] = o;
        }
      }
    } else {  // two passes; the weight-gradient sum in this block's workspace row
      for (int c = threadIdx.x; c < V; c += blockDim.x) {
        float a[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) a[e] = t == blockIdx.x ? 0.0f : mine[c * VEC + e];
        dot += grad_vec<S, VEC>(dyr[c], w[c], hr[c], r, gw[0], xh[0], a);
#pragma unroll
        for (int e = 0; e < VEC; ++e) mine[c * VEC + e] = a[e];
      }
      const float mean = block_sum(dot, red) / hf;
      for (int c = threadIdx.x; c < V; c += blockDim.x) {
        float unused[VEC] = {};
        grad_vec<S, VEC>(dyr[c], w[c], hr[c], r, gw[0], xh[0], unused);
        const W o = dx_vec<S, VEC, kDh>(gw[0], xh[0], r, mean, dhr, c);
        dx.row(g.row(t, xg))[c] = o;
        if constexpr (kDres) dres.row(t)[c] = o;
      }
    }
  }
  if constexpr (NV > 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < V) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) mine[c * VEC + e] = acc[i][e];
      }
    }
  }
}

// dweight[j] = sum over the blocks b, in order, of partial[b][j]
__global__ void __launch_bounds__(256) rms_norm_dweight_kernel(const float* __restrict__ partial, int64_t blocks,
                                                                int64_t H, float* __restrict__ dweight) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < H; j += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) s = cuda::add_rn(s, partial[b * H + j]);
    dweight[j] = s;
  }
}

}  // namespace

void rms_norm_backward_cuda(const TensorView& dout, const TensorView& dh, const TensorView& h, const TensorView& rstd,
                            const TensorView& weight, const RmsNormGrouping& g, TensorView& dx, TensorView& dres,
                            TensorView& dweight, TensorView& workspace, cudaStream_t stream) {
  const int64_t T = h.shape[0], H = h.shape[1], es = int64_t(dtype_size(h.dtype));
  float* dw = static_cast<float*>(dweight.data);
  if (T == 0 || H == 0) {
    if (H > 0) MMFUSE_CUDA_CHECK(cudaMemsetAsync(dw, 0, size_t(H) * sizeof(float), stream));
    return;
  }
  const bool has_dh = dh.defined(), has_dres = g.x_grouped;
  std::initializer_list<std::pair<const void*, int64_t>> rows = {
      {dout.data, dout.stride[0] * es}, {h.data, h.stride[0] * es}, {dx.data, dx.stride[0] * es},
      {weight.data, 0}, {has_dh ? dh.data : nullptr, has_dh ? dh.stride[0] * es : 0},
      {has_dres ? dres.data : nullptr, has_dres ? dres.stride[0] * es : 0}};
  const int64_t blocks = rms_norm::backward_blocks(T, cuda::sm_count(), rms_norm_backward_workspace_size(T, H) / H);
  float* partial = static_cast<float*>(workspace.data);
  cuda::dispatch_row_vectors<false>("rms_norm_backward: h", h.dtype, H, rows, [&](auto tag, auto vc) {
    using S = typename decltype(tag)::type;
    constexpr int VEC = decltype(vc)::value;
    using W = Vec<S, VEC>;
    const int V = int(H / VEC);
    const rms_norm::RowShape shape = rms_norm::row_shape(V);
    dispatch_nv(shape.vectors_per_thread, [&](auto nvc) {
      constexpr int NV = decltype(nvc)::value;
      auto go = [&](auto kdh, auto kdres) {
        constexpr bool D = decltype(kdh)::value, R = decltype(kdres)::value;
        rms_norm_bwd_kernel<S, VEC, NV, D, R><<<unsigned(blocks), shape.threads, 0, stream>>>(
            rows_of<W>(dout), has_dh ? rows_of<W>(dh) : Rows<W>{nullptr, 0}, rows_of<W>(h),
            static_cast<const float*>(rstd.data), static_cast<const W*>(weight.data), out_rows_of<W>(dx),
            has_dres ? out_rows_of<W>(dres) : OutRows<W>{nullptr, 0}, partial, T, V, float(H), groups_of(g, T),
            g.x_grouped, g.out_grouped);
      };
      if (has_dh && has_dres)
        go(std::true_type{}, std::true_type{});
      else if (has_dh)
        go(std::true_type{}, std::false_type{});
      else if (has_dres)
        go(std::false_type{}, std::true_type{});
      else
        go(std::false_type{}, std::false_type{});
      MMFUSE_CUDA_CHECK_LAUNCH("rms_norm_bwd_kernel");
    });
  });
  rms_norm_dweight_kernel<<<unsigned((H + 255) / 256), 256, 0, stream>>>(partial, blocks, H, dw);
  MMFUSE_CUDA_CHECK_LAUNCH("rms_norm_dweight_kernel");
}

}  // namespace detail
}  // namespace mmfuse
