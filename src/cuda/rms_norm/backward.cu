// CUDA backward of residual add + RMSNorm: a fixed set of rows a block (b, b + blocks, ...), the row
// in registers where it fits; dx and dresidual written once, the weight gradient as a per-block
// partial sum (registers, or the block's workspace row) and then summed over the blocks in order by
// a second kernel: no atomics, the same bits on every run.
#include "common/overrides.h"
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
                                              const Vec<S, VEC>& d) {
  Vec<S, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float v = cuda::mul_rn(r, cuda::sub_rn(gw[e], cuda::mul_rn(xh[e], mean)));
    if constexpr (kDh) v = cuda::add_rn(v, cuda::dload(d.v[e]));
    o.v[e] = cuda::dstore<S>(v);
  }
  return o;
}

// One row's inputs as a thread holds them in registers (the register-resident path).
template <class S, int VEC, int NV, bool kDh>
struct RowRegs {
  Vec<S, VEC> dy[NV], h[NV], dh[NV];
  float r;
  __device__ __forceinline__ void load(const Vec<S, VEC>* dyr, const Vec<S, VEC>* hr, const Vec<S, VEC>* dhr,
                                       const float* rstd, int64_t t, int V) {
    r = rstd[t];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < V) {
        dy[i] = dyr[c];
        h[i] = hr[c];
        if constexpr (kDh) dh[i] = dhr[c];
      }
    }
  }
};

template <class S, int VEC, int NV, bool kDh, bool kDres, bool kPrefetch>
__global__ void __launch_bounds__(rms_norm::kMaxThreads)
    rms_norm_bwd_kernel(Rows<Vec<S, VEC>> dout, Rows<Vec<S, VEC>> dh, Rows<Vec<S, VEC>> h,
                        const float* __restrict__ rstd, const Vec<S, VEC>* __restrict__ w, OutRows<Vec<S, VEC>> dx,
                        OutRows<Vec<S, VEC>> dres, float* __restrict__ partial, int64_t T, int V, float hf, Groups g,
                        bool xg, bool og) {
  using W = Vec<S, VEC>;
  __shared__ float red[32];
  float* mine = partial + int64_t(blockIdx.x) * V * VEC;  // [H]: this block's weight-gradient sum
  if constexpr (NV > 0) {
    // kPrefetch: the next row's loads are issued before this row's block-wide reduction, so that the
    // block keeps memory busy through its barriers, at the cost of a second row's registers.
    float acc[NV][VEC] = {};
    RowRegs<S, VEC, NV, kDh> cur, nxt;
    int64_t t = blockIdx.x;
    if (kPrefetch && t < T) cur.load(dout.row(g.row(t, og)), h.row(t), kDh ? dh.row(t) : nullptr, rstd, t, V);
    for (; t < T; t += gridDim.x) {
      if (!kPrefetch) cur.load(dout.row(g.row(t, og)), h.row(t), kDh ? dh.row(t) : nullptr, rstd, t, V);
      float dot = 0.0f;
      float gw[VEC], xh[VEC];  // recomputed after the reduction rather than held through it (registers)
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < V) dot += grad_vec<S, VEC>(cur.dy[i], w[c], cur.h[i], cur.r, gw, xh, acc[i]);
      }
      const int64_t tn = t + gridDim.x;
      if (kPrefetch && tn < T) nxt.load(dout.row(g.row(tn, og)), h.row(tn), kDh ? dh.row(tn) : nullptr, rstd, tn, V);
      const float mean = block_sum(dot, red) / hf;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < V) {
          float unused[VEC] = {};
          grad_vec<S, VEC>(cur.dy[i], w[c], cur.h[i], cur.r, gw, xh, unused);
          const W o = dx_vec<S, VEC, kDh>(gw, xh, cur.r, mean, cur.dh[i]);
          dx.row(g.row(t, xg))[c] = o;
          if constexpr (kDres) dres.row(t)[c] = o;
        }
      }
      if constexpr (kPrefetch) cur = nxt;
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < V) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) mine[c * VEC + e] = acc[i][e];
      }
    }
  } else {  // two passes a row; the weight-gradient sum in this block's workspace row
    float gw[VEC], xh[VEC];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
      const W* dyr = dout.row(g.row(t, og));
      const W* hr = h.row(t);
      const W* dhr = kDh ? dh.row(t) : nullptr;
      const float r = rstd[t];
      float dot = 0.0f;
      for (int c = threadIdx.x; c < V; c += blockDim.x) {
        float a[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) a[e] = t == blockIdx.x ? 0.0f : mine[c * VEC + e];
        dot += grad_vec<S, VEC>(dyr[c], w[c], hr[c], r, gw, xh, a);
#pragma unroll
        for (int e = 0; e < VEC; ++e) mine[c * VEC + e] = a[e];
      }
      const float mean = block_sum(dot, red) / hf;
      for (int c = threadIdx.x; c < V; c += blockDim.x) {
        float unused[VEC] = {};
        grad_vec<S, VEC>(dyr[c], w[c], hr[c], r, gw, xh, unused);
        W d;
        if constexpr (kDh) d = dhr[c];
        const W o = dx_vec<S, VEC, kDh>(gw, xh, r, mean, d);
        dx.row(g.row(t, xg))[c] = o;
        if constexpr (kDres) dres.row(t)[c] = o;
      }
    }
  }
}

// dweight[j] = the sum over the blocks b of partial[b][j]: a tile of 32 columns a block, its 32 warps
// each summing every 32nd partial row in order, then warp 0 summing the 32 warp sums in order: a fixed
// order (the same bits on every run) with enough loads in flight to read the partials at bandwidth.
constexpr int kDweightCols = 32, kDweightWarps = 32;
__global__ void __launch_bounds__(kDweightCols* kDweightWarps)
    rms_norm_dweight_kernel(const float* __restrict__ partial, int64_t blocks, int64_t H, float* __restrict__ dweight) {
  __shared__ float sums[kDweightWarps][kDweightCols + 1];
  const int lane = threadIdx.x % kDweightCols, warp = threadIdx.x / kDweightCols;
  const int64_t j = int64_t(blockIdx.x) * kDweightCols + lane;
  float s = 0.0f;
  if (j < H)
    for (int64_t b = warp; b < blocks; b += kDweightWarps) s = cuda::add_rn(s, partial[b * H + j]);
  sums[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && j < H) {
    float total = 0.0f;
#pragma unroll 8
    for (int k = 0; k < kDweightWarps; ++k) total = cuda::add_rn(total, sums[k][lane]);
    dweight[j] = total;
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
    const bool prefetch = rms_norm::backward_prefetch(shape.vectors_per_thread, path_override(Knob::kRmsNormBackward));
    dispatch_nv(shape.vectors_per_thread, [&](auto nvc) {
      constexpr int NV = decltype(nvc)::value;
      auto go = [&](auto kdh, auto kdres) {
        constexpr bool D = decltype(kdh)::value, R = decltype(kdres)::value;
        auto launch = [&](auto kpre) {
          rms_norm_bwd_kernel<S, VEC, NV, D, R, decltype(kpre)::value><<<unsigned(blocks), shape.threads, 0, stream>>>(
              rows_of<W>(dout), has_dh ? rows_of<W>(dh) : Rows<W>{nullptr, 0}, rows_of<W>(h),
              static_cast<const float*>(rstd.data), static_cast<const W*>(weight.data), out_rows_of<W>(dx),
              has_dres ? out_rows_of<W>(dres) : OutRows<W>{nullptr, 0}, partial, T, V, float(H), groups_of(g, T),
              g.x_grouped, g.out_grouped);
        };
        if constexpr (rms_norm::prefetch_compiled(NV)) {
          if (prefetch) return launch(std::true_type{});
        }
        launch(std::false_type{});
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
  rms_norm_dweight_kernel<<<unsigned((H + kDweightCols - 1) / kDweightCols), kDweightCols * kDweightWarps, 0, stream>>>(
      partial, blocks, H, dw);
  MMFUSE_CUDA_CHECK_LAUNCH("rms_norm_dweight_kernel");
}

}  // namespace detail
}  // namespace mmfuse
