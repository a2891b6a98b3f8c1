// MoE unpermute: out[t] = sum_k probs[t, k] * y[row_id_map[k][t]], fp32 (fp64 for fp64) in k order
// with explicit rounding, each output row written once. Three kernels, one arithmetic (bitwise
// equal): a warp a token at K <= 2, the token-tile kernel (TMA-staged rows, sm_90+) at K >= 3, and a
// flat kernel elsewhere; unpermute_path in path.h chooses.
#include "cuda/moe/tile.cuh"

namespace mmfuse {
namespace detail {
namespace {

// out[t] = sum_k w[t,k] * y[map[k][t]]: thread j sums vector j % V of token j / V (R vectors a
// thread), KG rows at a time, fp32 (fp64) in k order. Software-pipelined over the steps (vector
// group, k-group): the map entries of the next step are loaded while this step's rows are in flight,
// so a step costs one memory round trip, not two (map, then rows).
template <class S, int VEC, int KG, int R, bool kSmall>
__global__ void __launch_bounds__(kFlatThreads) moe_unpermute_kernel(const S* __restrict__ y, int64_t ys, int64_t N,
                                                                     S* __restrict__ out, int64_t os, MapRef map,
                                                                     const float* __restrict__ probs, int64_t ps0,
                                                                     int64_t ps1, int64_t T, int64_t K, uint32_t V,
                                                                     FastDiv dv) {
  using C = typename compute_type<S>::type;
  using W = Vec<S, VEC>;
  const int64_t total = T * V, step = int64_t(gridDim.x) * kFlatThreads * R;
  BadEntry bad;
  // (token, column) of the R vectors from j0, -1 past the end; the rows of their k-group k0
  auto locate = [&](int64_t j0, int64_t (&t)[R], int64_t (&col)[R]) {
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int64_t j = j0 + int64_t(u) * kFlatThreads;
      t[u] = -1, col[u] = 0;
      if (j < total) row_col<kSmall>(j, V, dv, t[u], col[u]);
    }
  };
  auto rows_of = [&](const int64_t (&t)[R], int64_t k0, int32_t (&r)[R][KG]) {
#pragma unroll
    for (int u = 0; u < R; ++u) {
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) r[u][kk] = -1;
      if (t[u] >= 0) load_rows<KG>(map, k0, K, t[u], N, r[u], bad);
    }
  };
  int64_t j0 = int64_t(blockIdx.x) * kFlatThreads * R + threadIdx.x, k0 = 0;
  int64_t t[R], col[R];
  int32_t r[R][KG];
  C acc[R][VEC];
  locate(j0, t, col);
  rows_of(t, 0, r);
  while (j0 < total) {
    if (k0 == 0) {
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[u][e] = C(0);
    }
    W v[R][KG];
    C w[R][KG];
#pragma unroll
    for (int u = 0; u < R; ++u)
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        if (r[u][kk] < 0) continue;
        v[u][kk] = load_ro(reinterpret_cast<const W*>(y + int64_t(r[u][kk]) * ys) + col[u]);
        w[u][kk] = probs ? C(probs[t[u] * ps0 + (k0 + kk) * ps1]) : C(1);
      }
    // the next step's map entries, in flight with this step's rows
    int64_t jn = j0, kn = k0 + KG, tn[R], cn[R];
    if (kn >= K) {
      kn = 0, jn = j0 + step;
      locate(jn, tn, cn);
    } else {
#pragma unroll
      for (int u = 0; u < R; ++u) tn[u] = t[u], cn[u] = col[u];
    }
    int32_t rn[R][KG];
    rows_of(tn, kn, rn);
#pragma unroll
    for (int u = 0; u < R; ++u)
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        if (r[u][kk] < 0) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          acc[u][e] = cuda::add_rn(acc[u][e], cuda::mul_rn(w[u][kk], C(cuda::dload(v[u][kk].v[e]))));
      }
    if (kn == 0) {
#pragma unroll
      for (int u = 0; u < R; ++u) {
        if (t[u] < 0) continue;
        W o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = cuda::dstore<S>(acc[u][e]);
        reinterpret_cast<W*>(out + t[u] * os)[col[u]] = o;
      }
    }
    j0 = jn, k0 = kn;
#pragma unroll
    for (int u = 0; u < R; ++u) {
      t[u] = tn[u], col[u] = cn[u];
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) r[u][kk] = rn[u][kk];
    }
  }
  if (bad.t >= 0) bad_row("moe_unpermute", map, bad.k, bad.t, N);
}

template <class S, int VEC, int KG, int CH>
__global__ void __launch_bounds__(kRowThreads)
    moe_unpermute_warp_kernel(const S* __restrict__ y, int64_t ys, int64_t N, S* __restrict__ out, int64_t os,
                              MapRef map, const float* __restrict__ probs, int64_t ps0, int64_t ps1, int64_t T,
                              int64_t K, uint32_t V) {
  using C = typename compute_type<S>::type;
  using W = Vec<S, VEC>;
  const int lane = threadIdx.x & 31;
  BadEntry bad;
  auto rows = [&](int64_t t, int32_t(&r)[KG]) { load_rows<KG>(map, 0, K, t, N, r, bad); };
  warp_walk<KG>(T, rows, [&](int64_t t, const int32_t(&r)[KG]) {
    C w[KG];
    const W* src[KG];
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) {
      w[kk] = probs && r[kk] >= 0 ? C(probs[t * ps0 + kk * ps1]) : C(1);
      src[kk] = reinterpret_cast<const W*>(y + int64_t(r[kk] >= 0 ? r[kk] : 0) * ys);
    }
    W* dst = reinterpret_cast<W*>(out + t * os);
    for (uint32_t c0 = lane; c0 < V; c0 += 32 * CH) {
      const int left = int(V - c0);  // vectors u * 32 < left of this lane's CH are in the row
      W v[KG][CH];
#pragma unroll
      for (int kk = 0; kk < KG; ++kk)
#pragma unroll
        for (int u = 0; u < CH; ++u)
          if (r[kk] >= 0 && u * 32 < left) v[kk][u] = load_ro(src[kk] + c0 + u * 32);
#pragma unroll
      for (int u = 0; u < CH; ++u) {
        if (u * 32 >= left) continue;
        C acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = C(0);
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) {
          if (r[kk] < 0) continue;
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            acc[e] = cuda::add_rn(acc[e], cuda::mul_rn(w[kk], C(cuda::dload(v[kk][u].v[e]))));
        }
        W o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = cuda::dstore<S>(acc[e]);
        dst[c0 + u * 32] = o;
      }
    }
  });
  if (bad.t >= 0) bad_row("moe_unpermute", map, bad.k, bad.t, N);
}

template <class S>
__global__ void __launch_bounds__(kTileThreads) moe_unpermute_tile_kernel(const TileArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = typename compute_type<S>::type;
  constexpr int VEC = int(16 / sizeof(S));
  using W = Vec<S, VEC>;
  extern __shared__ __align__(128) unsigned char smem[];
  const TileSmem s = tile_setup(a, smem, 32 * kTileConsumers);
  const int64_t t_begin = int64_t(blockIdx.x) * a.per_block, t_end = min(a.T, t_begin + a.per_block);
  if (threadIdx.x >= 32 * kTileConsumers) {
    BadEntry bad;
    tile_produce(a, s, t_begin, t_end, int(threadIdx.x / 32) - kTileConsumers, bad);
    if (bad.t >= 0) bad_row("moe_unpermute", a.map, bad.k, bad.t, a.N);
    return;
  }
  const int RB = a.row_bytes;
  const uint32_t V = uint32_t(RB / 16);
  tile_consume(a, s, t_begin, t_end, [&](int64_t t, const int32_t(&r)[kTileMaxK], const float(&w)[kTileMaxK],
                                         const unsigned char* rows) {
    for (uint32_t col = threadIdx.x; col < V; col += 32 * kTileConsumers) {
      C acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = C(0);
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) {
        if (r[kk] < 0) continue;
        const W v = reinterpret_cast<const W*>(rows + size_t(kk) * RB)[col];
        const C wk = C(w[kk]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = cuda::add_rn(acc[e], cuda::mul_rn(wk, C(cuda::dload(v.v[e]))));
      }
      W o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o.v[e] = cuda::dstore<S>(acc[e]);
      reinterpret_cast<W*>(a.out + t * a.os)[col] = o;
    }
  });
#else
  __trap();  // never launched: the host checks kernel_arch
#endif
}

}  // namespace

void moe_unpermute_cuda(const TensorView& y, const TensorView& map, const TensorView& probs, TensorView& out,
                        cudaStream_t stream) {
  const int64_t K = map.shape[0], T = map.shape[1], H = y.shape[1], N = y.shape[0];
  const int64_t es = int64_t(dtype_size(y.dtype));
  if (T == 0 || H == 0) return;
  dispatch_rows(y.dtype, "moe_unpermute: y", H, {{y.data, y.stride[0] * es}, {out.data, out.stride[0] * es}},
                [&](auto tag, auto vc) {
                  using D = typename std::decay_t<decltype(tag)>::type;
                  constexpr int VEC = std::decay_t<decltype(vc)>::value;
                  const uint32_t V = uint32_t(H / VEC);
                  const float* p = static_cast<const float*>(probs.data);
                  const void* tile_fn = nullptr;
                  TileArgs ta{};
                  TileShape shape;
                  if constexpr (kTileType<D, VEC>) {
                    if (K >= 3) {
                      tile_fn = reinterpret_cast<const void*>(&moe_unpermute_tile_kernel<D>);
                      ta = tile_args(y, map, probs, out);
                      ta.stage_bytes = ta.K * ta.row_bytes;
                      ta.stage_y = true;
                      shape = tile_shape_for(tile_fn, ta, 1);
                    }
                  }
                  const UnpermutePath path = unpermute_path(K, V, shape.stages > 0);
                  if (path.kernel == UnpermuteKernel::kWarp) {
                    // a warp for every token, a block for every kRowWarps tokens
                    auto go = [&](auto kgc, auto chc) {
                      constexpr int KG = decltype(kgc)::value, CH = decltype(chc)::value;
                      auto kernel = &moe_unpermute_warp_kernel<D, VEC, KG, CH>;
                      kernel<<<row_blocks(reinterpret_cast<const void*>(kernel), T, true), kRowThreads, 0,
                               stream>>>(
                          static_cast<const D*>(y.data), y.stride[0], N, static_cast<D*>(out.data), out.stride[0],
                          map_ref(map), p, p ? probs.stride[0] : 0, p ? probs.stride[1] : 0, T, K, V);
                    };
                    if (path.k_group == 2)
                      go(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
                    else if (path.chunk == 8)
                      go(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{});
                    else
                      go(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{});
                    MMFUSE_CUDA_CHECK_LAUNCH("moe_unpermute_warp_kernel");
                    return;
                  }
                  if (path.kernel == UnpermuteKernel::kTile)
                    return tile_launch(tile_fn, "moe_unpermute_tile_kernel", shape, ta, stream);
                  // The flat kernel: one vector a thread, two rows a step (more in flight a thread costs
                  // registers and loses).
                  auto kernel = T * V < (int64_t(1) << 31) ? &moe_unpermute_kernel<D, VEC, 2, 1, true>
                                                           : &moe_unpermute_kernel<D, VEC, 2, 1, false>;
                  kernel<<<flat_blocks(T * V, 1), kFlatThreads, 0, stream>>>(
                      static_cast<const D*>(y.data), y.stride[0], N, static_cast<D*>(out.data), out.stride[0],
                      map_ref(map), p, p ? probs.stride[0] : 0, p ? probs.stride[1] : 0, T, K, V, FastDiv(V));
                  MMFUSE_CUDA_CHECK_LAUNCH("moe_unpermute_kernel");
                });
}

}  // namespace detail
}  // namespace mmfuse
