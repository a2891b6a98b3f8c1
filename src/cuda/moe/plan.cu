// The MoE routing plan: a stable counting sort of the flattened expert ids (row_id_map, the expert
// counts and dst_to_src) with no atomics on global memory and no host sync.
//
// The entries are cut into C chunks (one block each). Each block counts its chunk's ids a warp per
// contiguous part (warp-aggregated: __match_any_sync, or two ballots for two experts) and writes the
// chunk histogram to the workspace (16-bit counts from kPlanNarrowExperts experts on); after a
// grid-wide dependency every block sums the histogram columns (its chunk's offset within each expert,
// and the expert totals), scans the totals into expert offsets, and ranks each entry among the equal
// ids of its warp: an entry's destination is offset(expert) + chunk offset + warp offset + rank.
// One cooperative launch, or two kernels as dependent launches (plan_path in path.h). Ids out of
// range stop the kernel with a message, reported after the hot loops so that the reporting call
// does not cost the loops registers.
#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>

#include "common/overrides.h"
#include "cuda/moe/common.cuh"

namespace mmfuse {
namespace detail {
namespace {

struct PlanArgs {
  IndexRef idx;
  FastDiv K;
  int32_t TK, E, n, per_block, C;
  bool contiguous;  // indices [T, K] row-major: entry i at offset i
  bool narrow;      // hist of uint16 rows of hist_w (a multiple of 8) counts, else int32 rows of E
  int32_t hist_w;
  void* hist;       // [C][hist_w]
  int32_t* map;
  int64_t map_s0, map_s1;
  int64_t* counts;
  int64_t counts_s;
  int32_t* d2s;
  int64_t d2s_s;
};

// (Scalars only: a reference to the kernel's parameter struct would copy it to local memory.)
__device__ __noinline__ void bad_expert(uint32_t t, uint32_t k, int64_t e, int32_t E) {
  MMFUSE_DEVICE_FAIL("moe_plan: indices[%u][%u] = %lld: expected an expert id in [0, %d)", t, k, (long long)e, E);
}

// Entry i of indices, unchecked.
__device__ __forceinline__ int64_t raw_id(const PlanArgs& a, int32_t i) {
  if (a.contiguous) {
    return a.idx.i64 ? __ldg(static_cast<const int64_t*>(a.idx.p) + i)
                     : int64_t(__ldg(static_cast<const int32_t*>(a.idx.p) + i));
  }
  const uint32_t t = a.K.div(uint32_t(i)), k = uint32_t(i) - t * a.K.d;
  return a.idx(t, k);
}

// The lanes of this warp holding the same id as this lane (invalid lanes hold -1). __match_any_sync,
// not a ballot of each bit of the ids: the ballots were slower at every E measured.
template <bool kTwo>
__device__ __forceinline__ unsigned peers_of(int e) {
  if constexpr (kTwo) {
    const unsigned one = __ballot_sync(0xffffffffu, e == 1), zero = __ballot_sync(0xffffffffu, e == 0);
    return e == 1 ? one : e == 0 ? zero : 0u;
  } else {
    return __match_any_sync(0xffffffffu, e);
  }
}

// The part of block c's chunk that warp w walks, [lo, hi): whole tiles of 32 * kPlanItems entries.
__device__ __forceinline__ void warp_part(const PlanArgs& a, int32_t c, int w, int32_t& lo, int32_t& hi) {
  const int32_t part = a.per_block / kPlanWarps;
  lo = min(c * a.per_block + w * part, a.TK);
  hi = min(lo + part, a.TK);
}

// The ids of the tile at base (entries base + u * 32 + lane; -1 past hi). Every load is issued
// before any check: the check's error report is a call, which no load can be moved across, so the
// loads overlap instead of making a round trip to memory each.
__device__ __forceinline__ void load_ids(const PlanArgs& a, int32_t base, int32_t hi, int (&e)[kPlanItems]) {
  const int lane = threadIdx.x & 31;
  int64_t v[kPlanItems];
#pragma unroll
  for (int u = 0; u < kPlanItems; ++u) {
    const int32_t i = base + u * 32 + lane;
    v[u] = i < hi ? raw_id(a, i) : -1;
  }
#pragma unroll
  for (int u = 0; u < kPlanItems; ++u) {
    const int32_t i = base + u * 32 + lane;
    if (i < hi && (v[u] < 0 || v[u] >= a.E)) {
      const uint32_t t = a.K.div(uint32_t(i));
      bad_expert(t, uint32_t(i) - t * a.K.d, v[u], a.E);
    }
    e[u] = int(v[u]);
  }
}

// Adds a tile's ids to cnt (this warp's row of counters, in shared memory); the peers of each id
// are left in `peers` for the rank walk.
template <bool kTwo>
__device__ __forceinline__ void count_tile(const int (&e)[kPlanItems], int32_t* cnt, unsigned (&peers)[kPlanItems]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kPlanItems; ++u) peers[u] = peers_of<kTwo>(e[u]);
#pragma unroll
  for (int u = 0; u < kPlanItems; ++u) {
    if (e[u] >= 0 && lane == __ffs(peers[u]) - 1) cnt[e[u]] += __popc(peers[u]);
    __syncwarp();
  }
}

// Phase 1 of block c: this chunk's per-warp counts into cnt ([kPlanWarps][E], cleared by the caller
// before a barrier), e and peers left holding the warp's last tile and its peers.
template <bool kTwo>
__device__ __forceinline__ void count_chunk(const PlanArgs& a, int32_t lo, int32_t hi, int (&e)[kPlanItems],
                                            int32_t* cnt, unsigned (&peers)[kPlanItems]) {
  for (int32_t base = lo; base < hi; base += 32 * kPlanItems) {
    if (base != lo) load_ids(a, base, hi, e);
    count_tile<kTwo>(e, cnt, peers);
  }
}

// Block c's chunk histogram (the column sums of cnt) to the workspace.
__device__ __forceinline__ void write_hist(const PlanArgs& a, const int32_t* cnt) {
  for (int32_t x = threadIdx.x; x < a.hist_w; x += blockDim.x) {
    int32_t s = 0;
    if (x < a.E) {
#pragma unroll
      for (int v = 0; v < kPlanWarps; ++v) s += cnt[v * a.E + x];
    }
    const int64_t at = int64_t(blockIdx.x) * a.hist_w + x;
    if (a.narrow)
      static_cast<uint16_t*>(a.hist)[at] = uint16_t(s);
    else
      static_cast<int32_t*>(a.hist)[at] = s;
  }
}

// The column sums of the chunk histograms into pre (the chunks before c) and tot (all chunks), both
// cleared by the caller: groups of threads split the chunks of each column.
__device__ __forceinline__ void column_sums(const PlanArgs& a, int32_t c, int32_t* pre, int32_t* tot) {
  if (a.narrow) {  // 16-byte loads of 8 counts: all of a thread's in one round trip where E > 256
    // (Where V >= 32, as under auto, which takes it from V = 64, the lanes of a warp add to distinct
    // addresses in each shared atomic.)
    const int32_t V = a.hist_w / 8, G = V >= kPlanThreads ? 1 : kPlanThreads / V;
    const uint4* h4 = static_cast<const uint4*>(a.hist);
    for (int32_t j = threadIdx.x; j < V * G; j += blockDim.x) {
      const int32_t v = j % V, g = j / V;
      int32_t s[8] = {}, p[8] = {};
#pragma unroll 8
      for (int32_t q = g; q < a.C; q += G) {
        const uint4 h = h4[int64_t(q) * V + v];
        const uint32_t w[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int32_t n = int32_t((w[i / 2] >> (16 * (i % 2))) & 0xffffu);
          s[i] += n;
          p[i] += q < c ? n : 0;
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int32_t x = v * 8 + i;
        if (x < a.E) {
          atomicAdd(&pre[x], p[i]);
          atomicAdd(&tot[x], s[i]);
        }
      }
    }
    return;
  }
  const int32_t E = a.E, G = E >= kPlanThreads ? 1 : kPlanThreads / E;
  const int32_t* hist = static_cast<const int32_t*>(a.hist);
  for (int32_t j = threadIdx.x; j < E * G; j += blockDim.x) {
    const int32_t x = j % E, g = j / E;
    int32_t p = 0, s = 0;
    // Unrolled 32 deep: at E = 64, C = 128 a thread's 32 chunks go out in one round trip to L2.
#pragma unroll 32
    for (int32_t q = g; q < a.C; q += G) {
      const int32_t h = hist[q * E + x];
      s += h;
      p += q < c ? h : 0;
    }
    atomicAdd(&pre[x], p);
    atomicAdd(&tot[x], s);
  }
}

// Phase 2 of block c, after every chunk's histogram is written: the column sums (this chunk's offset
// within each expert, pre, and the expert totals, tot; both cleared by the caller), the expert
// offsets (an exclusive scan of the totals, kPlanThreads experts at a time), each warp's first
// destination of every expert (in cnt, which holds the warp counts), then the ranks and the writes.
// e and pk hold the warp's first tile and its peers when its part is one tile (one_tile).
template <bool kTwo>
__device__ __forceinline__ void rank_chunk(const PlanArgs& a, int32_t lo, int32_t hi, bool one_tile,
                                           int (&e)[kPlanItems], const unsigned (&pk)[kPlanItems], int32_t* cnt,
                                           int32_t* pre, int32_t* tot) {
  const int32_t E = a.E, c = blockIdx.x;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  column_sums(a, c, pre, tot);
  __syncthreads();
  using Scan = cub::BlockScan<int32_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int32_t carry = 0;
  for (int32_t e0 = 0; e0 < E; e0 += kPlanThreads) {
    const int32_t x = e0 + threadIdx.x;
    const int32_t v = x < E ? tot[x] : 0;
    int32_t ex, sum;
    Scan(scan_tmp).ExclusiveSum(v, ex, sum);
    const int32_t base = carry + ex;
    if (x < E) {
      if (c == 0) a.counts[x * a.counts_s] = min(base + v, a.n) - min(base, a.n);
      int32_t run = base + pre[x];
#pragma unroll
      for (int v2 = 0; v2 < kPlanWarps; ++v2) {
        const int32_t n_w = cnt[v2 * E + x];
        cnt[v2 * E + x] = run;
        run += n_w;
      }
    }
    carry += sum;
    __syncthreads();  // scan_tmp is reused
  }
  // rank and write
  const unsigned lt = (1u << lane) - 1u;
  int32_t* mine = cnt + w * E;
  for (int32_t base = lo; base < hi; base += 32 * kPlanItems) {
    if (!one_tile) load_ids(a, base, hi, e);
#pragma unroll
    for (int u = 0; u < kPlanItems; ++u) {
      const unsigned peers = one_tile ? pk[u] : peers_of<kTwo>(e[u]);
      const int32_t dst = e[u] >= 0 ? mine[e[u]] + __popc(peers & lt) : 0;
      __syncwarp();
      if (e[u] >= 0) {
        if (lane == __ffs(peers) - 1) mine[e[u]] += __popc(peers);
        const int32_t i = base + u * 32 + lane;
        const uint32_t t = a.K.div(uint32_t(i)), k = uint32_t(i) - t * a.K.d;
        const bool kept = dst < a.n;
        a.map[k * a.map_s0 + t * a.map_s1] = kept ? dst : -1;
        if (kept) a.d2s[int64_t(dst) * a.d2s_s] = i;
      }
      __syncwarp();
    }
  }
}

// The whole plan in one launch: count, a grid-wide barrier, rank (cooperative launch: all C blocks
// resident). Shared memory: cnt [kPlanWarps][E], pre [E], tot [E].
template <bool kTwo>
__global__ void __launch_bounds__(kPlanThreads) moe_plan_kernel(PlanArgs a) {
  extern __shared__ int32_t sm[];
  int32_t* cnt = sm + (threadIdx.x >> 5) * a.E;
  int32_t* pre = sm + kPlanWarps * a.E;
  int32_t lo, hi;
  warp_part(a, blockIdx.x, threadIdx.x >> 5, lo, hi);
  const bool one_tile = hi - lo <= 32 * kPlanItems;  // then the ids stay in registers for both walks
  int e[kPlanItems];
  if (lo < hi) load_ids(a, lo, hi, e);  // first tile in flight while the counters are cleared
  for (int32_t j = threadIdx.x; j < (kPlanWarps + 2) * a.E; j += blockDim.x) sm[j] = 0;
  __syncthreads();
  unsigned peers[kPlanItems];
  count_chunk<kTwo>(a, lo, hi, e, cnt, peers);
  __syncthreads();
  write_hist(a, sm);
  cooperative_groups::this_grid().sync();
  rank_chunk<kTwo>(a, lo, hi, one_tile, e, peers, sm, pre, pre + a.E);
}

// The same in two launches: where the C blocks cannot all be resident at once, and on sm_90+ where
// the recount is one tile a warp, both as programmatic dependent launches (PDL), so that they cost
// no launch gap and no grid-wide barrier:
// - the count kernel's blocks start while the work before the plan finishes and wait for it (it may
//   have written the ids), then let the rank kernel launch;
// - the rank blocks load and count their ids meanwhile (the ids are ready: every count block has
//   waited) and wait for the whole count grid (its histogram writes visible) only before they read
//   the histograms;
// - the rank kernel lets what comes next launch at once: a plain launch still waits for the whole
//   plan, and the one programmatic dependent launch here that can follow a plan directly, another
//   plan's count kernel, reads nothing before its wait.
// (Without PDL the griddepcontrol instructions are no-ops: stream order already holds.)
template <bool kTwo>
__global__ void __launch_bounds__(kPlanThreads) moe_count_kernel(PlanArgs a) {
  pdl_wait_primary();       // the work before the plan (it may write the ids) has finished
  pdl_launch_dependents();  // only then: the rank blocks read the ids before their own wait
  extern __shared__ int32_t sm[];  // [kPlanWarps][E]
  int32_t lo, hi;
  warp_part(a, blockIdx.x, threadIdx.x >> 5, lo, hi);
  int e[kPlanItems];
  if (lo < hi) load_ids(a, lo, hi, e);
  for (int32_t j = threadIdx.x; j < kPlanWarps * a.E; j += blockDim.x) sm[j] = 0;
  __syncthreads();
  unsigned peers[kPlanItems];
  count_chunk<kTwo>(a, lo, hi, e, sm + (threadIdx.x >> 5) * a.E, peers);
  __syncthreads();
  write_hist(a, sm);
}

template <bool kTwo>
__global__ void __launch_bounds__(kPlanThreads) moe_rank_kernel(PlanArgs a) {
  pdl_launch_dependents();  // what follows the plan may launch: see above
  extern __shared__ int32_t sm[];  // cnt [kPlanWarps][E], pre [E], tot [E]
  int32_t* pre = sm + kPlanWarps * a.E;
  int32_t lo, hi;
  warp_part(a, blockIdx.x, threadIdx.x >> 5, lo, hi);
  const bool one_tile = hi - lo <= 32 * kPlanItems;
  int e[kPlanItems];
  if (lo < hi) load_ids(a, lo, hi, e);
  for (int32_t j = threadIdx.x; j < (kPlanWarps + 2) * a.E; j += blockDim.x) sm[j] = 0;
  __syncthreads();
  unsigned peers[kPlanItems];
  count_chunk<kTwo>(a, lo, hi, e, sm + (threadIdx.x >> 5) * a.E, peers);  // the warp counts again
  pdl_wait_primary();  // the count grid has finished: every chunk's histogram is written
  rank_chunk<kTwo>(a, lo, hi, one_tile, e, peers, sm, pre, pre + a.E);
}

// Blocks of `kernel` (kPlanThreads threads, `smem` dynamic bytes) resident at once on the device.
int resident_blocks(const void* kernel, size_t smem) { return cuda::resident_blocks(kernel, kPlanThreads, smem); }

}  // namespace

void moe_plan_cuda(const TensorView& idx, int64_t E, int64_t n, TensorView& map, TensorView& counts, TensorView& d2s,
                   TensorView& ws, cudaStream_t stream) {
  const int64_t T = idx.shape[0], K = idx.shape[1], TK = T * K;  // TK < 2^31, E <= 4096: checked
  PlanArgs a;
  a.idx = cuda::index_ref(idx);
  a.K = FastDiv(uint32_t(std::max<int64_t>(K, 1)));
  a.contiguous = idx.stride[1] == 1 && idx.stride[0] == K;
  a.TK = int32_t(TK);
  a.E = int32_t(E);
  a.n = int32_t(n);
  a.per_block = int32_t(moe_plan_block_entries(TK, E));
  a.C = int32_t(std::max<int64_t>(1, (TK + a.per_block - 1) / a.per_block));
  a.hist = ws.data;
  a.map = static_cast<int32_t*>(map.data);
  a.map_s0 = map.stride[0];
  a.map_s1 = map.stride[1];
  a.counts = static_cast<int64_t*>(counts.data);
  a.counts_s = counts.stride[0];
  a.d2s = static_cast<int32_t*>(d2s.data);
  a.d2s_s = d2s.ndim ? d2s.stride[0] : 1;
  // The two kernels' shared memory alike: with more in the rank kernel alone, its blocks no longer
  // share an SM with the count kernel's (another carveout) and the PDL overlap is lost.
  const size_t smem_count = size_t(kPlanWarps) * E * 4, smem_rank = size_t(kPlanWarps + 2) * E * 4;
  auto go = [&](auto two) {
    constexpr bool kTwo = decltype(two)::value;
    const void* fused = reinterpret_cast<const void*>(&moe_plan_kernel<kTwo>);
    const void* rank = reinterpret_cast<const void*>(&moe_rank_kernel<kTwo>);
    set_smem(fused, smem_rank);
    const PlanPath path = plan_path(cuda::kernel_arch(rank), E, a.per_block, a.C, resident_blocks(fused, smem_rank),
                                    reinterpret_cast<uintptr_t>(ws.data) % 16 == 0,
                                    PlanLaunch(path_override(Knob::kMoePlan)),
                                    PlanHist(path_override(Knob::kMoePlanHist)));
    a.narrow = path.narrow;
    a.hist_w = a.narrow ? int32_t((E + 7) / 8 * 8) : int32_t(E);
    if (path.cooperative) {
      void* args[] = {&a};  // one launch: count, grid barrier, rank
      MMFUSE_CUDA_CHECK(cudaLaunchCooperativeKernel(fused, dim3(unsigned(a.C)), dim3(kPlanThreads), args, smem_rank,
                                                    stream));
      MMFUSE_CUDA_CHECK_LAUNCH("moe_plan_kernel");
      return;
    }
    set_smem(reinterpret_cast<const void*>(&moe_count_kernel<kTwo>), smem_count);
    set_smem(rank, smem_rank);
    {
      const DependentLaunch launch(dim3(unsigned(a.C)), dim3(kPlanThreads), smem_count, stream, path.pdl);
      MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, &moe_count_kernel<kTwo>, a));
      MMFUSE_CUDA_CHECK_LAUNCH("moe_count_kernel");
    }
    const DependentLaunch launch(dim3(unsigned(a.C)), dim3(kPlanThreads), smem_rank, stream, path.pdl);
    MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, &moe_rank_kernel<kTwo>, a));
    MMFUSE_CUDA_CHECK_LAUNCH("moe_rank_kernel");
  };
  if (E <= 2)
    go(std::true_type{});
  else
    go(std::false_type{});
}

}  // namespace detail
}  // namespace mmfuse
