// Backward of MoE unpermute: dy[row(t, k)] = probs[t, k] * dout[t] and dprobs[t, k] =
// dot(dout[t], y[row(t, k)]), dout read once a token, sums in a fixed order (deterministic). Every
// row written is counted in a workspace (cleared first, by atomic reductions that nobody waits for);
// a last small launch zeroes the rows no entry maps to and stops at a row two entries map to.
// Kernels: a warp a token (K = 1), a warp an entry, the token-tile kernel (sm_90+), and a general
// block kernel; unpermute_backward_path in path.h chooses.
#include "common/overrides.h"
#include "cuda/moe/tile.cuh"

namespace mmfuse {
namespace detail {
namespace {

__device__ __noinline__ void duplicate_row(int32_t r) {
  MMFUSE_DEVICE_FAIL("moe_unpermute_backward: row_id_map: row %d is the destination of two entries", r);
}

// Backward of unpermute. Block: x threads over a row's vectors, y over tokens (blockDim.y tokens at
// a time). dy[row(t,k)] = w * dout[t]; dprobs[t,k] = dot(dout[t], y[row(t,k)]): per-thread sums,
// then warp sums, then the warps of the token in order (deterministic). Every row written is counted
// in `writes` (one count a row), for the zeroing of the others and the check of duplicates after.
template <class S, int VEC, int KG>
__global__ void __launch_bounds__(256) moe_unpermute_bwd_kernel(
    const S* __restrict__ dout, int64_t gs, const S* __restrict__ y, int64_t ys, S* __restrict__ dy, int64_t dys,
    int64_t N, MapRef map, const float* __restrict__ probs, int64_t ps0, int64_t ps1, float* __restrict__ dprobs,
    int64_t dps0, int64_t dps1, uint32_t* __restrict__ writes, int64_t T, int64_t K, uint32_t V) {
  using C = typename compute_type<S>::type;
  using W = Vec<S, VEC>;
  constexpr int kMaxWarps = 8;
  __shared__ C partial[kMaxWarps][KG];  // [warp of the block][kk]
  const int lane = threadIdx.x & 31, wx = threadIdx.x >> 5, warps_x = blockDim.x >> 5;
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  BadEntry bad;
  // Software-pipelined over the steps (token group, k-group): the next step's map entries are loaded
  // while this step's rows are in flight.
  auto rows_of = [&](int64_t t, int64_t k0, int32_t (&r)[KG]) {
    if (t < T) {
      load_rows<KG>(map, k0, K, t, N, r, bad);
    } else {
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) r[kk] = -1;
    }
  };
  int64_t tb = int64_t(blockIdx.x) * blockDim.y, k0 = 0;
  int32_t r[KG];
  rows_of(tb + threadIdx.y, 0, r);
  while (tb < T) {  // uniform over the block (the barriers below)
    const int64_t t = tb + threadIdx.y;
    const bool active = t < T;
    int64_t kn = k0 + KG, tbn = tb;
    if (kn >= K) kn = 0, tbn = tb + step;
    int32_t rn[KG];
    rows_of(tbn + threadIdx.y, kn, rn);
    {
      C w[KG], dot[KG];
      int32_t mine = -1;
#pragma unroll
      for (int kk = 0; kk < KG; ++kk)
        if (threadIdx.x == kk) mine = r[kk];
      if (mine >= 0) atomicAdd(&writes[mine], 1u);  // no value returned: a reduction, not waited for
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        w[kk] = probs && r[kk] >= 0 ? C(probs[t * ps0 + (k0 + kk) * ps1]) : C(1);
        dot[kk] = C(0);
      }
      for (uint32_t col = threadIdx.x; col < V; col += blockDim.x) {
        if (!active) break;
        const W g = load_ro(reinterpret_cast<const W*>(dout + t * gs) + col);
        W v[KG];
        if (dprobs) {
#pragma unroll
          for (int kk = 0; kk < KG; ++kk)
            if (r[kk] >= 0) v[kk] = load_ro(reinterpret_cast<const W*>(y + int64_t(r[kk]) * ys) + col);
        }
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) {
          if (r[kk] < 0) continue;
          W d;
#pragma unroll
          for (int e = 0; e < VEC; ++e) d.v[e] = cuda::dstore<S>(cuda::mul_rn(w[kk], C(cuda::dload(g.v[e]))));
          reinterpret_cast<W*>(dy + int64_t(r[kk]) * dys)[col] = d;
          if (dprobs) {
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              dot[kk] = cuda::add_rn(dot[kk], cuda::mul_rn(C(cuda::dload(g.v[e])), C(cuda::dload(v[kk].v[e]))));
          }
        }
      }
      if (dprobs) {
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) dot[kk] = cuda::add_rn(dot[kk], __shfl_xor_sync(0xffffffffu, dot[kk], o));
        }
        if (lane == 0) {
#pragma unroll
          for (int kk = 0; kk < KG; ++kk) partial[threadIdx.y * warps_x + wx][kk] = dot[kk];
        }
        __syncthreads();
        if (threadIdx.x < KG && active && k0 + threadIdx.x < K) {
          C sum = C(0);
          for (int v = 0; v < warps_x; ++v) sum = cuda::add_rn(sum, partial[threadIdx.y * warps_x + v][threadIdx.x]);
          dprobs[t * dps0 + (k0 + threadIdx.x) * dps1] = mine >= 0 ? float(sum) : 0.0f;
        }
        __syncthreads();
      }
    }
    tb = tbn, k0 = kn;
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) r[kk] = rn[kk];
  }
  if (bad.t >= 0) bad_row("moe_unpermute_backward", map, bad.k, bad.t, N);
}

// Backward of unpermute a warp a token (K = 1) or, kEntry, a warp
// an entry (KG = 1; item i is entry k = i % K of token t = i / K, so that a block's warps share the
// token's dout row in cache): dy[row(t,k)] = w * dout[t] and dprobs[t,k] = dot(dout[t], y[row(t,k)]),
// each lane CH vectors of dout and of each of the KG rows at a time with all their loads issued
// before any store, the next item's map entries loaded with this item's rows. Lane l sums its
// columns l, l + 32, ... in order and the warp adds the lanes' sums by a butterfly: the operations of
// the token-tile kernel, bitwise equal. Rows written are counted in `writes`; on sm_90+ the kernel
// is a programmatic dependent launch of the kernel that zeroes them (moe_clear_kernel), and waits
// for it only before its first count.
template <class S, int VEC, int KG, int CH, bool kEntry>
__global__ void __launch_bounds__(kRowThreads) moe_unpermute_bwd_warp_kernel(
    const S* __restrict__ dout, int64_t gs, const S* __restrict__ y, int64_t ys, S* __restrict__ dy, int64_t dys,
    int64_t N, MapRef map, const float* __restrict__ probs, int64_t ps0, int64_t ps1, float* __restrict__ dprobs,
    int64_t dps0, int64_t dps1, uint32_t* __restrict__ writes, int64_t T, FastDiv K, uint32_t V) {
  static_assert(!kEntry || KG == 1, "a warp an entry takes one row");
  using C = typename compute_type<S>::type;
  using W = Vec<S, VEC>;
  const int lane = threadIdx.x & 31;
  BadEntry bad;
  bool cleared = false;  // the counts are zero (the primary grid has finished)
  auto at = [&](int64_t i, int64_t& t, int64_t& k0) {  // item i: token t, its entries from k0
    if constexpr (kEntry) {
      t = K.div(uint32_t(i));  // T * K < 2^31: checked by the host
      k0 = i - t * K.d;
    } else {
      t = i, k0 = 0;
    }
  };
  auto rows = [&](int64_t i, int32_t(&r)[KG]) {
    int64_t t, k0;
    at(i, t, k0);
    load_rows<KG>(map, k0, K.d, t, N, r, bad);
  };
  warp_walk<KG>(kEntry ? T * K.d : T, rows, [&](int64_t i, const int32_t(&r)[KG]) {
    int64_t t, k0;
    at(i, t, k0);
    C w[KG], dot[KG];
    int32_t rl = -1;  // lane kk: entry k0 + kk, counted as written
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) {
      w[kk] = probs && r[kk] >= 0 ? C(probs[t * ps0 + (k0 + kk) * ps1]) : C(1);
      dot[kk] = C(0);
      if (lane == kk) rl = r[kk];
    }
    if (!cleared) {
      pdl_wait_primary();
      cleared = true;
    }
    // No value returned: a reduction, which the warp does not wait for (a check of the old value
    // would hold the warp a round trip a token).
    if (rl >= 0) atomicAdd(&writes[rl], 1u);
    const W* g = reinterpret_cast<const W*>(dout + t * gs);
    for (uint32_t c0 = lane; c0 < V; c0 += 32 * CH) {
      const int left = int(V - c0);  // vectors u * 32 < left of this lane's CH are in the row
      W gv[CH], yv[KG][CH];
#pragma unroll
      for (int u = 0; u < CH; ++u)
        if (u * 32 < left) gv[u] = load_ro(g + c0 + u * 32);
      if (dprobs) {
#pragma unroll
        for (int kk = 0; kk < KG; ++kk)
#pragma unroll
          for (int u = 0; u < CH; ++u)
            if (r[kk] >= 0 && u * 32 < left)
              yv[kk][u] = load_ro(reinterpret_cast<const W*>(y + int64_t(r[kk]) * ys) + c0 + u * 32);
      }
#pragma unroll
      for (int u = 0; u < CH; ++u) {
        if (u * 32 >= left) continue;
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) {
          if (r[kk] < 0) continue;
          W d;
#pragma unroll
          for (int e = 0; e < VEC; ++e) d.v[e] = cuda::dstore<S>(cuda::mul_rn(w[kk], C(cuda::dload(gv[u].v[e]))));
          reinterpret_cast<W*>(dy + int64_t(r[kk]) * dys)[c0 + u * 32] = d;
          if (dprobs) {
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              dot[kk] = cuda::add_rn(dot[kk], cuda::mul_rn(C(cuda::dload(gv[u].v[e])), C(cuda::dload(yv[kk][u].v[e]))));
          }
        }
      }
    }
    if (dprobs) {
      C mine = C(0);
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot[kk] = cuda::add_rn(dot[kk], __shfl_xor_sync(0xffffffffu, dot[kk], o));
        if (lane == kk) mine = dot[kk];
      }
      if (lane < KG && k0 + lane < K.d) dprobs[t * dps0 + (k0 + lane) * dps1] = rl >= 0 ? float(mine) : 0.0f;
    }
  });
  if (bad.t >= 0) bad_row("moe_unpermute_backward", map, bad.k, bad.t, N);
}

template <class S>
__global__ void __launch_bounds__(kTileThreads) moe_unpermute_bwd_tile_kernel(const TileArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = typename compute_type<S>::type;
  constexpr int VEC = int(16 / sizeof(S));
  using W = Vec<S, VEC>;
  extern __shared__ __align__(128) unsigned char smem[];
  const TileSmem s = tile_setup(a, smem, 32);
  const int64_t t_begin = int64_t(blockIdx.x) * a.per_block, t_end = min(a.T, t_begin + a.per_block);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, RB = a.row_bytes;
  if (warp >= kTileConsumers) {
    BadEntry bad;
    tile_produce(a, s, t_begin, t_end, warp - kTileConsumers, bad);
    if (bad.t >= 0) bad_row("moe_unpermute_backward", a.map, bad.k, bad.t, a.N);
    return;
  }
  if (warp >= a.seqs) return;
  const uint32_t V = uint32_t(RB / 16);
  for (int64_t m = warp; m < t_end - t_begin; m += a.seqs) {
    const int64_t t = t_begin + m;
    int st;
    uint32_t fill;
    tile_slot(a, uint32_t(m), st, fill);
    const unsigned char* stage = s.stages + size_t(st) * a.stage_bytes;
    cuda::mbar_wait(&s.full[st], fill & 1u);
    int32_t r[kTileMaxK];
    C w[kTileMaxK], dot[kTileMaxK];
#pragma unroll
    for (int kk = 0; kk < kTileMaxK; ++kk) r[kk] = s.meta[st].r[kk], w[kk] = C(s.meta[st].w[kk]), dot[kk] = C(0);
    const int32_t rl = lane < kTileMaxK ? s.meta[st].r[lane] : -1;  // lane kk: entry kk, counted as written
    if (rl >= 0) atomicAdd(&a.writes[rl], 1u);
    for (uint32_t col = lane; col < V; col += 32) {
      const W g = reinterpret_cast<const W*>(stage)[col];
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) {
        if (r[kk] < 0) continue;
        W d;
#pragma unroll
        for (int e = 0; e < VEC; ++e) d.v[e] = cuda::dstore<S>(cuda::mul_rn(w[kk], C(cuda::dload(g.v[e]))));
        reinterpret_cast<W*>(a.out + int64_t(r[kk]) * a.os)[col] = d;
        if (a.stage_y) {
          const W v = reinterpret_cast<const W*>(stage + size_t(1 + kk) * RB)[col];
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            dot[kk] = cuda::add_rn(dot[kk], cuda::mul_rn(C(cuda::dload(g.v[e])), C(cuda::dload(v.v[e]))));
        }
      }
    }
    cuda::mbar_arrive(&s.empty[st]);  // every lane: an arrival releases the arriving thread's reads only
    if (a.dprobs) {
      C mine = C(0);
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) {
        if (kk >= a.K) break;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot[kk] = cuda::add_rn(dot[kk], __shfl_xor_sync(0xffffffffu, dot[kk], o));
        if (lane == kk) mine = dot[kk];
      }
      if (lane < a.K) a.dprobs[t * a.dps0 + lane * a.dps1] = rl >= 0 ? float(mine) : 0.0f;
    }
  }
#else
  __trap();  // never launched: the host checks kernel_arch
#endif
}

// Zeroes the backward's row counts. Its dependent (the warp-a-token row kernel, a programmatic
// dependent launch on sm_90+) may start at once: it waits for this grid before its first count.
__global__ void __launch_bounds__(256) moe_clear_kernel(uint32_t* __restrict__ writes, int64_t n) {
  pdl_launch_dependents();
  for (int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x; i < n; i += int64_t(gridDim.x) * 256) writes[i] = 0;
}

// After the row kernel: zeroes the rows of dy no entry mapped to (a count of 0) and stops at a row
// that two entries mapped to (a count above 1). A block looks at 256 rows' counts, then clears those
// rows.
template <int B>
__global__ void __launch_bounds__(256) moe_zero_rows_kernel(const uint32_t* __restrict__ writes, char* __restrict__ dy,
                                                            int64_t dys, int64_t N, uint32_t V) {
  using U = typename Bytes<B>::type;
  __shared__ int32_t rows[256];
  __shared__ int n_rows;
  pdl_wait_primary();  // a programmatic dependent launch: the row kernel's counts are all in
  for (int64_t r0 = int64_t(blockIdx.x) * 256; r0 < N; r0 += int64_t(gridDim.x) * 256) {
    if (threadIdx.x == 0) n_rows = 0;
    __syncthreads();
    const int64_t r = r0 + threadIdx.x;
    const uint32_t n = r < N ? writes[r] : 1u;
    if (n > 1u) duplicate_row(int32_t(r));
    if (n == 0u) rows[atomicAdd(&n_rows, 1)] = int32_t(r);
    __syncthreads();
    for (int i = 0; i < n_rows; ++i) {
      U* row = reinterpret_cast<U*>(dy + int64_t(rows[i]) * dys);
      for (uint32_t c = threadIdx.x; c < V; c += blockDim.x) row[c] = U{};
    }
    __syncthreads();
  }
}

}  // namespace

void moe_unpermute_backward_cuda(const TensorView& dout, const TensorView& y, const TensorView& map,
                                 const TensorView& probs, TensorView& dy, TensorView& dprobs, TensorView& ws,
                                 cudaStream_t stream) {
  const int64_t K = map.shape[0], T = map.shape[1], H = y.shape[1], N = y.shape[0];
  const int64_t es = int64_t(dtype_size(y.dtype));
  // The writes of each row, counted by the row kernel without waiting for the old value (a
  // reduction), checked after it by the zero-rows kernel.
  uint32_t* writes = static_cast<uint32_t*>(ws.data);
  {
    const int64_t n = moe_unpermute_backward_workspace_size(N);
    moe_clear_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, int64_t(1) << 16)), 256, 0, stream>>>(writes, n);
    MMFUSE_CUDA_CHECK_LAUNCH("moe_clear_kernel");
  }
  const BwdForce force = BwdForce(path_override(Knob::kMoeBackward));
  dispatch_rows(
      y.dtype, "moe_unpermute_backward: y", H,
      {{y.data, y.stride[0] * es}, {dout.data, dout.stride[0] * es}, {dy.data, dy.stride[0] * es}},
      [&](auto tag, auto vc) {
        using D = typename std::decay_t<decltype(tag)>::type;
        constexpr int VEC = std::decay_t<decltype(vc)>::value;
        const uint32_t V = uint32_t(H / VEC);
        const float* p = static_cast<const float*>(probs.data);
        float* dp = static_cast<float*>(dprobs.data);
        // the rows of dy no entry maps to; rows two entries map to: an error. A programmatic
        // dependent launch on sm_90+: its launch overlaps the row kernel's last blocks.
        auto zero_unwritten = [&] {
          if (N == 0) return;
          constexpr int B = VEC * int(sizeof(D));
          const unsigned grid = unsigned(std::min<int64_t>((N + 255) / 256, int64_t(1) << 20));
          auto kernel = &moe_zero_rows_kernel<B>;
          const DependentLaunch launch(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(256), 0, stream);
          MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, static_cast<const uint32_t*>(writes),
                                               static_cast<char*>(dy.data), dy.stride[0] * es, N, V));
          MMFUSE_CUDA_CHECK_LAUNCH("moe_zero_rows_kernel");
        };
        // The warp-walk kernels (rows in flight in registers, no shared memory), each a programmatic
        // dependent launch of moe_clear_kernel on sm_90+: a warp a token (K = 1: 4 vectors of dout
        // and of the row a lane at a time) or a warp an entry (4 vectors a lane).
        auto by_warps = [&](bool entry) {
          auto go = [&](auto ec) {
            constexpr bool kEntry = decltype(ec)::value;
            auto kernel = &moe_unpermute_bwd_warp_kernel<D, VEC, 1, 4, kEntry>;
            const void* fn = reinterpret_cast<const void*>(kernel);
            const DependentLaunch launch(fn, dim3(row_blocks(fn, kEntry ? T * K : T)), dim3(kRowThreads), 0, stream);
            const int64_t ps0 = p ? probs.stride[0] : 0, ps1 = p ? probs.stride[1] : 0;
            const int64_t dps0 = dp ? dprobs.stride[0] : 0, dps1 = dp ? dprobs.stride[1] : 0;
            MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, static_cast<const D*>(dout.data), dout.stride[0],
                                                 static_cast<const D*>(y.data), y.stride[0], static_cast<D*>(dy.data),
                                                 dy.stride[0], N, map_ref(map), p, ps0, ps1, dp, dps0, dps1, writes, T,
                                                 FastDiv(uint32_t(K)), V));
            MMFUSE_CUDA_CHECK_LAUNCH("moe_unpermute_bwd_warp_kernel");
          };
          if (entry)
            go(std::true_type{});
          else
            go(std::false_type{});
          zero_unwritten();
        };
        const void* tile_fn = nullptr;
        TileArgs ta{};
        TileShape shape;
        if constexpr (kTileType<D, VEC>) {
          ta = tile_args(y, map, probs, dy);
          ta.g = static_cast<const char*>(dout.data);
          ta.gs = dout.stride[0] * es;
          ta.dprobs = dp;
          ta.dps0 = dp ? dprobs.stride[0] : 0;
          ta.dps1 = dp ? dprobs.stride[1] : 0;
          ta.writes = writes;
          ta.stage_y = dp != nullptr;
          ta.stage_bytes = (1 + (dp ? ta.K : 0)) * ta.row_bytes;
          if (ta.stage_bytes <= kBwdTileMaxStageBytes) {
            tile_fn = reinterpret_cast<const void*>(&moe_unpermute_bwd_tile_kernel<D>);
            shape = tile_shape_for(tile_fn, ta, kTileConsumers);
          }
        }
        switch (unpermute_backward_path(T, K, shape.stages > 0, force)) {
          case BwdKernel::kWarpEntry: return by_warps(true);
          case BwdKernel::kWarpToken: return by_warps(false);
          case BwdKernel::kTile:
            tile_launch(tile_fn, "moe_unpermute_bwd_tile_kernel", shape, ta, stream);
            return zero_unwritten();
          case BwdKernel::kGeneral: break;
        }
        if (T > 0 && K > 0) {
          // blocks of 256 threads: x over a row's vectors (32..256), y over tokens; a 1-D grid over tokens
          uint32_t bx = 32;
          while (bx < V && bx < 256) bx *= 2;
          const dim3 block(bx, 256 / bx);
          const dim3 grid(unsigned(std::min<int64_t>((T + block.y - 1) / block.y, int64_t(1) << 20)));
          auto launch = [&](auto kg) {
            constexpr int KG = decltype(kg)::value;
            moe_unpermute_bwd_kernel<D, VEC, KG><<<grid, block, 0, stream>>>(
                static_cast<const D*>(dout.data), dout.stride[0], static_cast<const D*>(y.data), y.stride[0],
                static_cast<D*>(dy.data), dy.stride[0], N, map_ref(map), p, p ? probs.stride[0] : 0,
                p ? probs.stride[1] : 0, dp, dp ? dprobs.stride[0] : 0, dp ? dprobs.stride[1] : 0, writes, T, K, V);
          };
          if (K == 1)
            launch(std::integral_constant<int, 1>{});
          else
            launch(std::integral_constant<int, 2>{});
          MMFUSE_CUDA_CHECK_LAUNCH("moe_unpermute_bwd_kernel");
        }
        zero_unwritten();
      });
}

}  // namespace detail
}  // namespace mmfuse
