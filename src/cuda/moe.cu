// CUDA backend of the MoE routing.
//
// Plan: a stable counting sort of the flattened expert ids in one cooperative launch. The entries are
// cut into C chunks (one block each). Each block counts its chunk's ids a warp per contiguous part
// (warp-aggregated: __match_any_sync, or two ballots for two experts) and writes the chunk histogram
// to the workspace (at 512 experts and more, 16-bit counts: see plan_hist); after a grid-wide
// barrier every block sums the histogram columns (its chunk's offset within each expert, and the
// expert totals), scans the totals into expert offsets, and ranks
// each entry among the equal ids of its warp, so that an entry's destination is offset(expert) +
// chunk offset + warp offset + rank. (On sm_90+ where each warp's part is one tile, and where the C
// blocks cannot all be resident, the same in two launches, the second counting again: see
// moe_count_kernel.) No atomics on global memory, no host sync, deterministic; ids
// out of range stop the kernel with a message (reported after the hot loops, so that the reporting
// call does not cost the loops registers). Where a plan's time goes, phase by phase inside a CUDA
// graph, and the variants measured against it: docs/benchmarks.md, 2026-12-06 17:46-18:16.
//
// Data movement is token-centric so that each input row is read once: permute reads x[t] and writes
// its K destination rows; unpermute reads the K rows of token t and writes out[t]; the backward reads
// dout[t] once and writes K rows of dy. Rows move as 16-byte vectors when their size and alignment
// allow (8, 4, 2, 1 otherwise); sums are fp32 (fp64 for fp64) in k order with explicit rounding.
// Unpermute at K <= 2 and its backward at K = 1 run a warp a token (rows in flight in registers),
// the backward at K = 2 a warp an entry; with 3 to 8 rows a token unpermute takes a token-tile path
// on sm_90+ (TMA bulk copies of whole rows into staged shared memory; see below), as does the
// backward for tokens of up to 48 KB, and larger ones a warp an entry.
// The backward also counts the writes of each row (caller workspace, cleared first) with atomic
// reductions, whose old values nobody waits for; a last small launch zeroes the rows no entry maps
// to and stops at a row two entries map to.
#include <cuda_runtime.h>

#include <algorithm>
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "common/env.h"
#include "cuda/device_util.cuh"
#include "cuda/numerics.cuh"
#include "cuda/tma.cuh"
#include "mmfuse/moe.h"

namespace mmfuse {
namespace detail {
namespace {

using cuda::dcompute;
using cuda::device_type;
using cuda::IndexRef;
using cuda::Vec;

// A plan block: 8 warps, 2 ids a lane a tile. (4 ids a lane, half the blocks, took 0.3-0.7 us more a
// plan at T*K 16K-64K on an H100, 2026-12-06; 4 warps of 4 ids, 0.5-1.1 us more.)
constexpr int kPlanWarps = 8, kPlanThreads = kPlanWarps * 32, kPlanItems = 2;
static_assert(kPlanThreads * kPlanItems == 512, "the tile of moe_plan_block_entries");

// n / d for 0 <= n < 2^31 with a multiply-high (no integer division on the device).
struct FastDiv {
  uint32_t d = 1, m = 1, s = 0;
  explicit FastDiv(uint32_t div = 1) : d(div) {
    while ((uint64_t(1) << s) < d) ++s;
    m = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << s) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};

struct MapRef {  // row_id_map [K, T] int32
  const int32_t* p;
  int64_t s0, s1;
  __device__ int32_t operator()(int64_t k, int64_t t) const { return p[k * s0 + t * s1]; }
};
MapRef map_ref(const TensorView& m) { return {static_cast<const int32_t*>(m.data), m.stride[0], m.stride[1]}; }

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

// The lanes of this warp holding the same id as this lane (invalid lanes hold -1). (A ballot of
// each bit of the ids instead of __match_any_sync was slower: H100 2026-12-06 13:42, us a plan, 20 in
// a graph: top-2 of 64 T32k 6.10 vs 5.63, top-2 of 8 5.17 vs 4.74, top-8 of 4096 T8k 119.7 vs 92.6;
// and again at 18:09 at E <= 256, 0.3-0.6 us slower at E = 8 and 16, within 0.2 at E = 64, although
// a dependent chain of __match_any_sync takes 57 cycles at 1 distinct id and 320-400 at 25.)
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
    // E = 64, C = 128: a thread's 32 chunks in one round trip to L2. Measured on an H100 (2026-12-06
    // ~09:14 UTC, us a plan, 20 in a graph, two rounds; unrolled 32 vs 16): top-2 of 64 T32k 6.04 vs
    // 6.26, top-8 of 64 T8k dropped 6.12 vs 6.32, T64k 22.25 vs 22.7; E <= 8 the same. (The compiler
    // still issues them in waves, and at E = 8 the four of a thread one at a time; staging all of them
    // at once with cp.async was no faster at E = 8 and 0.6 us slower at E = 64: 2026-12-06 10:51.)
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
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The launch configuration of a kernel that follows another in `stream`: with `pdl`, a programmatic
// dependent launch (the kernel calls pdl_wait_primary() before it reads what the one before wrote),
// else plain stream order; given the kernel, PDL where it was built for sm_90+. cfg points into the
// object: not copyable.
struct DependentLaunch {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  DependentLaunch(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream)
      : DependentLaunch(grid, block, smem, stream, cuda::kernel_arch(kernel) >= 90) {}
  DependentLaunch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
  }
  DependentLaunch(const DependentLaunch&) = delete;
  DependentLaunch& operator=(const DependentLaunch&) = delete;
};

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

// ---- row movement ----

template <int B>
struct Bytes;
template <> struct Bytes<16> { using type = uint4; };
template <> struct Bytes<8> { using type = uint2; };
template <> struct Bytes<4> { using type = uint32_t; };
template <> struct Bytes<2> { using type = uint16_t; };
template <> struct Bytes<1> { using type = uint8_t; };

// A read-only (non-coherent cache) load of a trivially copyable value of 1, 2, 4, 8 or 16 bytes.
template <class T>
__device__ __forceinline__ T load_ro(const T* p) {
  const auto u = __ldg(reinterpret_cast<const typename Bytes<int(sizeof(T))>::type*>(p));
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

// The widest access (bytes) dividing every row's size, stride and base address.
int vec_bytes(int64_t row_bytes, std::initializer_list<std::pair<const void*, int64_t>> rows) {
  for (int b : {16, 8, 4, 2}) {
    bool ok = row_bytes % b == 0;
    for (const auto& [p, stride_bytes] : rows)
      ok = ok && reinterpret_cast<uintptr_t>(p) % b == 0 && stride_bytes % b == 0;
    if (ok) return b;
  }
  return 1;
}

template <class F>
void dispatch_vec(int b, F&& f) {
  switch (b) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// The first bad row_id_map entry a thread met. Threads skip bad entries (no out-of-bounds access)
// and report at their end, so that the reporting call stays out of the hot loop's registers.
struct BadEntry {
  int64_t k = 0, t = -1;
};

__device__ __noinline__ void bad_row(const char* op, MapRef m, int64_t k, int64_t t, int64_t rows) {
  MMFUSE_DEVICE_FAIL("%s: row_id_map[%lld][%lld] = %d: expected -1 or a row in [0, %lld)", op, (long long)k,
                     (long long)t, m(k, t), (long long)rows);
}

// Rows of token t's k-group (-1 past K; bad entries recorded and read as -1).
template <int KG>
__device__ __forceinline__ void load_rows(const MapRef& m, int64_t k0, int64_t K, int64_t t, int64_t rows,
                                          int32_t (&r)[KG], BadEntry& bad) {
#pragma unroll
  for (int kk = 0; kk < KG; ++kk) {
    r[kk] = k0 + kk < K ? m(k0 + kk, t) : -1;
    if (r[kk] < -1 || r[kk] >= rows) {
      if (bad.t < 0) bad = {k0 + kk, t};
      r[kk] = -1;
    }
  }
}

using cuda::sm_count;

// Blocks of `kernel` (kPlanThreads threads, `smem` dynamic bytes) resident at once on the device.
int resident_blocks(const void* kernel, size_t smem) { return cuda::resident_blocks(kernel, kPlanThreads, smem); }

constexpr int kFlatThreads = 256, kPermUnroll = 4;

// Blocks for a flattened kernel over `work` items, `per_thread` each: enough to fill the GPU, then loop
// (`all`: enough for every item, up to 2^30 blocks, so that the hardware hands out the work).
unsigned flat_blocks(int64_t work, int per_thread, bool all = false) {
  const int64_t per_block = int64_t(kFlatThreads) * per_thread;
  const int64_t cap = all ? int64_t(1) << 30 : int64_t(sm_count()) * 16;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, cap)));
}

// Vector j of a flattened [rows, V] walk: (row, col), with a multiply-high division when the walk is
// below 2^31 vectors (kSmall), a 64-bit one otherwise.
template <bool kSmall>
__device__ __forceinline__ void row_col(int64_t j, uint32_t V, const FastDiv& dv, int64_t& row, int64_t& col) {
  if constexpr (kSmall) {
    const uint32_t r = dv.div(uint32_t(j));
    row = r;
    col = int64_t(uint32_t(j) - r * V);
  } else {
    row = j / V;
    col = j - row * V;
  }
}

// out[map[k][t]] = x[t]: thread j moves vector j % V of token j / V to its K rows; each x row is
// read once. kPermUnroll vectors a thread are loaded before any store. kStream: streaming stores
// (st.global.cs), which keep the K written copies from evicting the rows still to be read.
template <int B, bool kSmall, int KG, bool kStream>
__global__ void __launch_bounds__(kFlatThreads) moe_permute_kernel(const char* __restrict__ x, int64_t xs,
                                                                   char* __restrict__ out, int64_t os, int64_t N,
                                                                   MapRef map, int64_t T, int64_t K, uint32_t V,
                                                                   FastDiv dv) {
  using U = typename Bytes<B>::type;
  const int64_t total = T * V, step = int64_t(gridDim.x) * kFlatThreads * kPermUnroll;
  BadEntry bad;
  for (int64_t j0 = int64_t(blockIdx.x) * kFlatThreads * kPermUnroll + threadIdx.x; j0 < total; j0 += step) {
    U v[kPermUnroll];
    int64_t t[kPermUnroll], col[kPermUnroll];
#pragma unroll
    for (int u = 0; u < kPermUnroll; ++u) {
      const int64_t j = j0 + int64_t(u) * kFlatThreads;
      t[u] = -1;
      if (j < total) {
        row_col<kSmall>(j, V, dv, t[u], col[u]);
        v[u] = __ldg(reinterpret_cast<const U*>(x + t[u] * xs) + col[u]);
      }
    }
    for (int64_t k = 0; k < K; k += KG) {
      int32_t r[kPermUnroll][KG];
#pragma unroll
      for (int u = 0; u < kPermUnroll; ++u) {
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) r[u][kk] = -1;
        if (t[u] >= 0) load_rows<KG>(map, k, K, t[u], N, r[u], bad);
      }
#pragma unroll
      for (int u = 0; u < kPermUnroll; ++u)
#pragma unroll
        for (int kk = 0; kk < KG; ++kk)
          if (r[u][kk] >= 0) {
            U* dst = reinterpret_cast<U*>(out + int64_t(r[u][kk]) * os) + col[u];
            if constexpr (kStream)
              __stcs(dst, v[u]);
            else
              *dst = v[u];
          }
    }
  }
  if (bad.t >= 0) bad_row("moe_permute", map, bad.k, bad.t, N);
}

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
  using C = typename dcompute<S>::type;
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
  using C = typename dcompute<S>::type;
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

// ---- K <= 2: a warp a token ----
// Top-1 and top-2 routing (the two-expert pattern, top-2 of 8) move whole rows with little
// arithmetic. A warp takes a token at a time, each lane CH vectors of each of the token's KG rows
// at a time with all their loads issued before any store, and the next token's map entries are
// loaded with this token's rows: more bytes in flight a thread than the flattened kernels, no
// shared memory and no producer. The arithmetic is that of the kernels above, in the same order
// (fp32 from zero in k order: bitwise equal to the token-tile kernel it replaced at K <= 2).
constexpr int kRowThreads = 256, kRowWarps = kRowThreads / 32;

// The items of this warp (warp w of the grid: w, w + warps, ... < n), body(i, r) for each with r
// its KG rows of the map as load(i, r) gives them (-1: none); the next item's rows are loaded before
// body runs, so that they are in flight with this item's rows.
template <int KG, class L, class F>
__device__ __forceinline__ void warp_walk(int64_t n, L&& load, F&& body) {
  const int64_t step = int64_t(gridDim.x) * kRowWarps;
  int64_t i = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  int32_t r[KG];
#pragma unroll
  for (int kk = 0; kk < KG; ++kk) r[kk] = -1;
  if (i < n) load(i, r);
  for (; i < n; i += step) {
    int32_t rn[KG];
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) rn[kk] = -1;
    if (i + step < n) load(i + step, rn);
    body(i, static_cast<const int32_t(&)[KG]>(r));
#pragma unroll
    for (int kk = 0; kk < KG; ++kk) r[kk] = rn[kk];
  }
}

template <class S, int VEC, int KG, int CH>
__global__ void __launch_bounds__(kRowThreads)
    moe_unpermute_warp_kernel(const S* __restrict__ y, int64_t ys, int64_t N, S* __restrict__ out, int64_t os,
                              MapRef map, const float* __restrict__ probs, int64_t ps0, int64_t ps1, int64_t T,
                              int64_t K, uint32_t V) {
  using C = typename dcompute<S>::type;
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

// Backward of unpermute a warp a token (auto at K = 1; K <= 8 with MMFUSE_MOE_BWD=warp) or, kEntry, a warp
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
  using C = typename dcompute<S>::type;
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
    // No value returned: a reduction, which the warp does not wait for. (An atomicOr into a bitmap,
    // its old value checked for duplicates, held the warp a round trip a token: on the H200 two
    // experts T16k H2048 ran at 75.1 % of copy against 81.7, T64k at 84.6 against 92.8.)
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

// Blocks of a warp-walk kernel over n items: enough for every item, at most those resident at once
// (each warp then walks items, the next one's map entries in flight with this one's rows; `all`: a
// warp for every item, up to 2^30 blocks, so that the hardware hands out the work).
unsigned row_blocks(const void* kernel, int64_t n, bool all = false) {
  const int64_t cap = all ? int64_t(1) << 30 : int64_t(cuda::resident_blocks(kernel, kRowThreads, 0));
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kRowWarps - 1) / kRowWarps, cap)));
}

// ---- token-tile paths (sm_90+): unpermute and its backward ----
// Rows of 16-byte multiples, 1 <= K <= kTileMaxK. A persistent block owns a contiguous range of
// tokens. Its last one or two warps are producers, warp p of P taking the tokens p (mod P) and the
// stages they map to, which no other producer touches. A producer reads the row_id_map and
// probabilities of its tokens 32 at a time (a batch ahead) and, once a stage's previous token has
// been released on the stage's `empty` mbarrier, writes the token's entries and weights into the
// stage's slot and stages its rows, one 1-D bulk copy (TMA) a row, completing on the stage's
// `full` mbarrier (which the producer's own arrival also orders its slot writes before). The
// consumer warps never wait for each other or for a block barrier, and every consumer thread
// arrives on `empty` itself (an arrival releases only the arriving thread's reads; racecheck holds
// us to that).
// - unpermute: a stage holds token t's K rows of y; all 256 consumer threads sum them in fp32 in k
//   order (columns over the threads), the operations of moe_unpermute_kernel: bitwise equal.
// - backward: a stage holds dout[t] and, when dprobs is wanted, token t's K rows of y; consumer
//   warp w < W owns the tokens w (mod W) and stages of its own (W = min(8, stages that fit)), so a
//   token's dot products need warp sums only.
constexpr int kTileMaxK = 8, kTileMaxStages = 16, kTileConsumers = 8, kTileMaxProducers = 2;
constexpr int kTileThreads = 32 * (kTileConsumers + kTileMaxProducers);  // the most a block launches
constexpr size_t kTileSmemBudget = 224 * 1024;

struct TileArgs {
  const char* y;  // rows ys bytes apart, N rows
  int64_t ys, N;
  const char* g;  // backward: dout rows (gs bytes apart); unpermute: nullptr
  int64_t gs;
  char* out;  // unpermute: out; backward: dy (rows os bytes apart)
  int64_t os;
  MapRef map;
  const float* probs;
  int64_t ps0, ps1;
  float* dprobs;  // backward, nullptr when not wanted
  int64_t dps0, dps1;
  uint32_t* writes;  // backward: the writes of each row (counted)
  int64_t T, per_block;
  int K, row_bytes;
  int stage_bytes;  // a stage: [the g row] then, if stage_y, the token's K rows of y
  int stages;
  int seqs;  // stage sequences: token m goes to sequence m % seqs (its stages: stages / seqs)
  int producers;  // producer warps: warp p stages tokens p (mod producers), whose stages no other touches
  bool stage_y;
};

// Stage and fill number (0, 1, ...) of token m of the block's range. Each sequence's consumers take
// every fill of their stages in order, so a wait on a fill's parity can never see an older phase.
__device__ __forceinline__ void tile_slot(const TileArgs& a, uint32_t m, int& st, uint32_t& fill) {
  const uint32_t per = uint32_t(a.stages / a.seqs), j = m / uint32_t(a.seqs);
  st = int(m % uint32_t(a.seqs) * per + j % per);
  fill = j / per;
}

// A stage's token: its map entries (-1: none) and weights.
struct TileMeta {
  int32_t r[kTileMaxK];
  float w[kTileMaxK];
};
constexpr size_t kTileStageExtra = sizeof(TileMeta) + 16;  // a stage's slot and barriers

// Shared memory of a tile kernel: the stages, their slots, then their full and empty barriers.
size_t tile_smem(int stage_bytes, int stages) { return size_t(stages) * (size_t(stage_bytes) + kTileStageExtra); }

struct TileSmem {
  unsigned char* stages;
  TileMeta* meta;
  uint64_t* full;
  uint64_t* empty;
};

// Carves the shared memory and initialises the barriers (`releases` arrivals empty a stage); a block barrier.
__device__ __forceinline__ TileSmem tile_setup(const TileArgs& a, unsigned char* smem, unsigned releases) {
  TileSmem s;
  s.stages = smem;
  s.meta = reinterpret_cast<TileMeta*>(smem + size_t(a.stages) * a.stage_bytes);
  s.full = reinterpret_cast<uint64_t*>(s.meta + a.stages);
  s.empty = s.full + a.stages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < a.stages; ++i) {
      cuda::mbar_init(&s.full[i], 1);
      cuda::mbar_init(&s.empty[i], releases);
    }
    cuda::fence_mbar_init();
  }
  __syncthreads();
  return s;
}

// A producer's walk over the tokens first, first + stride, ... (< t_end): lane l holds the map
// entries and weights of one token of the current batch of 32 and of the next (a batch ahead), and
// next() hands every lane those of the walk's next token. Bad entries are recorded in `bad` and
// read as -1; entries past K and tokens past t_end, -1.
struct TileWalk {
  int32_t r[kTileMaxK], rn[kTileMaxK];
  float w[kTileMaxK], wn[kTileMaxK];
  int64_t first, t_end, stride;
  uint32_t j = 0;

  __device__ __forceinline__ void load(const TileArgs& a, int64_t b, int32_t (&r_)[kTileMaxK],
                                       float (&w_)[kTileMaxK], BadEntry& bad) {
    const int64_t t = first + (b * 32 + (threadIdx.x & 31)) * stride;
    if (t < t_end) {
      load_rows<kTileMaxK>(a.map, 0, a.K, t, a.N, r_, bad);
    } else {
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) r_[kk] = -1;
    }
#pragma unroll
    for (int kk = 0; kk < kTileMaxK; ++kk)  // not waiting for r: the weight of an entry kept or not
      w_[kk] = a.probs && kk < a.K && t < t_end ? a.probs[t * a.ps0 + kk * a.ps1] : 1.0f;
  }
  __device__ __forceinline__ TileWalk(const TileArgs& a, int64_t first_, int64_t t_end_, int64_t stride_,
                                      BadEntry& bad)
      : first(first_), t_end(t_end_), stride(stride_) {
    load(a, 0, r, w, bad);
    load(a, 1, rn, wn, bad);
  }
  // The next token's entries and weights (kk < K), the same in every lane.
  __device__ __forceinline__ void next(const TileArgs& a, int32_t (&ro)[kTileMaxK], float (&wo)[kTileMaxK],
                                       BadEntry& bad) {
    const int i = int(j & 31u);
    if (i == 0 && j > 0) {
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) r[kk] = rn[kk], w[kk] = wn[kk];
      load(a, int64_t(j / 32 + 1), rn, wn, bad);
    }
#pragma unroll
    for (int kk = 0; kk < kTileMaxK; ++kk) {
      ro[kk] = -1, wo[kk] = 1.0f;
      if (kk < a.K) {
        ro[kk] = __shfl_sync(0xffffffffu, r[kk], i);
        wo[kk] = __shfl_sync(0xffffffffu, w[kk], i);
      }
    }
    ++j;
  }
};

// Producer warp p: every token p (mod producers) of [t_begin, t_end) into its stage, in order.
__device__ __forceinline__ void tile_produce(const TileArgs& a, const TileSmem& s, int64_t t_begin, int64_t t_end,
                                             int p, BadEntry& bad) {
  const int lane = threadIdx.x & 31, RB = a.row_bytes, lead = a.g ? 1 : 0;
  TileWalk walk(a, t_begin + p, t_end, a.producers, bad);
  for (int64_t m = p; m < t_end - t_begin; m += a.producers) {
    int32_t r[kTileMaxK];
    float w[kTileMaxK];
    walk.next(a, r, w, bad);
    if (lane == 0) {
      int st;
      uint32_t fill;
      tile_slot(a, uint32_t(m), st, fill);
      if (fill > 0) cuda::mbar_wait(&s.empty[st], (fill - 1) & 1u);  // the stage's previous token released
      unsigned char* dst = s.stages + size_t(st) * a.stage_bytes;
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) s.meta[st].r[kk] = r[kk], s.meta[st].w[kk] = w[kk];
      unsigned bytes = lead ? unsigned(RB) : 0u;
#pragma unroll
      for (int kk = 0; kk < kTileMaxK; ++kk) bytes += a.stage_y && r[kk] >= 0 ? unsigned(RB) : 0u;
      cuda::mbar_arrive_expect_tx(&s.full[st], bytes);
      if (lead) cuda::bulk_load(dst, a.g + (t_begin + m) * a.gs, RB, &s.full[st]);
      if (a.stage_y) {
#pragma unroll
        for (int kk = 0; kk < kTileMaxK; ++kk)
          if (r[kk] >= 0) cuda::bulk_load(dst + (lead + kk) * RB, a.y + int64_t(r[kk]) * a.ys, RB, &s.full[st]);
      }
    }
    __syncwarp();
  }
}

// The 256 consumer threads of a one-sequence kernel: every token t of [t_begin, t_end) in order,
// body(t, r, w, stage) once its stage is full.
template <class F>
__device__ __forceinline__ void tile_consume(const TileArgs& a, const TileSmem& s, int64_t t_begin, int64_t t_end,
                                             F&& body) {
  int st = 0;
  unsigned ph = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    cuda::mbar_wait(&s.full[st], ph);
    int32_t r[kTileMaxK];
    float w[kTileMaxK];
#pragma unroll
    for (int kk = 0; kk < kTileMaxK; ++kk) r[kk] = s.meta[st].r[kk], w[kk] = s.meta[st].w[kk];
    body(t, r, w, s.stages + size_t(st) * a.stage_bytes);
    cuda::mbar_arrive(&s.empty[st]);
    if (++st == a.stages) st = 0, ph ^= 1u;
  }
}

template <class S>
__global__ void __launch_bounds__(kTileThreads) moe_unpermute_tile_kernel(const TileArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = typename dcompute<S>::type;
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

template <class S>
__global__ void __launch_bounds__(kTileThreads) moe_unpermute_bwd_tile_kernel(const TileArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = typename dcompute<S>::type;
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

void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    MMFUSE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// The token-tile kernel `fn` where it applies (rows of 16-byte vectors, 1 <= K <= kTileMaxK, two
// stages at least in the budget, an sm_90+ kernel); false: the caller takes the general kernel. `a`
// has all but the launch shape: stages, seqs (<= max_seqs) and per_block.
bool tile_launch(const void* fn, const char* name, int max_seqs, TileArgs a, cudaStream_t stream) {
  if (a.K < 1 || a.K > kTileMaxK || a.T < 1 || a.row_bytes % 16) return false;
  const int64_t per_stage = int64_t(a.stage_bytes) + int64_t(kTileStageExtra);
  const int fit = int(std::min<int64_t>(kTileMaxStages, int64_t(kTileSmemBudget) / per_stage));
  if (fit < 2 || cuda::kernel_arch(fn) < 90) return false;
  a.seqs = std::min(max_seqs, fit);
  a.stages = fit / a.seqs * a.seqs;
  // Two producer warps where each can have a set of stages of its own (an even number of
  // sequences, or of stages in one sequence), else one. A producer's per-token steps (map entries
  // to all lanes, slot writes, one bulk copy a row) are a serial chain of a few hundred
  // instructions (ncu, H200 2026-12-04): a second one lifted the 8 KB tokens of top-1 unpermute
  // from 70.5 to 74.2 % of copy and top-8 of 64 at H2048 from 96.4 to 99.0; four gained nothing
  // more; taking a stage off the 13 of top-2 at H4096 to pair them lost 2-3 points.
  a.producers = (a.seqs > 1 ? a.seqs : a.stages) % 2 == 0 ? kTileMaxProducers : 1;
  const int threads = 32 * (kTileConsumers + a.producers);
  const size_t smem = tile_smem(a.stage_bytes, a.stages);
  set_smem(fn, smem);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(a.T, cuda::resident_blocks(fn, threads, smem)));
  a.per_block = (a.T + grid - 1) / grid;
  void* args[] = {&a};
  MMFUSE_CUDA_CHECK(cudaLaunchKernel(fn, dim3(unsigned((a.T + a.per_block - 1) / a.per_block)), dim3(threads),
                                     args, smem, stream));
  MMFUSE_CUDA_CHECK_LAUNCH(name);
  return true;
}

// Types the tile kernels take: 16-byte vectors of a 16- or 32-bit type.
template <class D, int VEC>
constexpr bool kTileType = sizeof(D) <= 4 && VEC * sizeof(D) == 16;

// The fields of the tile paths that unpermute and its backward share.
TileArgs tile_args(const TensorView& y, const TensorView& map, const TensorView& probs, TensorView& out) {
  const int64_t es = int64_t(dtype_size(y.dtype));
  TileArgs a{};
  a.y = static_cast<const char*>(y.data);
  a.ys = y.stride[0] * es;
  a.N = y.shape[0];
  a.out = static_cast<char*>(out.data);
  a.os = out.stride[0] * es;
  a.map = map_ref(map);
  a.probs = static_cast<const float*>(probs.data);
  a.ps0 = a.probs ? probs.stride[0] : 0;
  a.ps1 = a.probs ? probs.stride[1] : 0;
  a.T = map.shape[1];
  a.K = int(std::min<int64_t>(map.shape[0], kTileMaxK + 1));
  a.row_bytes = int(std::min<int64_t>(y.shape[1] * es, int64_t(kTileSmemBudget)));
  return a;
}

}  // namespace

// MMFUSE_MOE_PLAN, the plan's launches, for tests and measurements: auto (unset: see moe_plan_cuda),
// cooperative (the cooperative kernel where its blocks fit at once, else the two kernels in stream
// order) or two (the count and rank kernels in plain stream order).
enum class PlanMode { kAuto, kCooperative, kTwo };
PlanMode plan_mode() {
  return PlanMode(env_choice("moe_plan", "MMFUSE_MOE_PLAN", {"auto", "cooperative", "two"}));
}

// MMFUSE_MOE_PLAN_HIST, the chunk histograms, for tests and measurements: auto (unset: 16-bit counts
// from kPlanNarrowExperts experts on), wide (int32 counts) or narrow (16-bit counts at any E). Either
// falls back to int32 where a chunk has 2^16 entries or more, or the workspace is not 16-byte aligned.
// The 16-bit rows halve the column sums' bytes and take 8 experts a 16-byte load, so that at E > 256
// a thread's loads go out in one round trip instead of one for every 256 experts; below, the extra
// unpacking and shared atomics cost more than they save. Measured on an H100 (2026-12-06 14:12 UTC,
// us a plan, 20 in a CUDA graph, wide / narrow, two rounds within 0.2): top-8 of 128 T4k 5.0 / 5.9,
// of 256 5.9 / 6.1, of 384 10.0 / 10.4; top-10 of 512 T4k 20.3 / 12.7 (T8k 16.4 both); top-8 of 768
// 22.4 / 14.3, of 1024 T4k 26.1 / 15.0, of 2048 35.6 / 25.0, of 4096 T8k 90.0 / 78.7; E <= 64 at
// T*K = 64K 0.2-1.1 slower narrow.
enum class PlanHist { kAuto, kWide, kNarrow };
PlanHist plan_hist() { return PlanHist(env_choice("moe_plan", "MMFUSE_MOE_PLAN_HIST", {"auto", "wide", "narrow"})); }
constexpr int64_t kPlanNarrowExperts = 512;

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
  // 16-bit histograms where a chunk's count of an expert fits and the workspace allows 16-byte loads
  const PlanHist hist = plan_hist();
  a.narrow = hist != PlanHist::kWide && a.per_block <= 0xffff && reinterpret_cast<uintptr_t>(ws.data) % 16 == 0 &&
             (hist == PlanHist::kNarrow || E >= kPlanNarrowExperts);
  a.hist_w = a.narrow ? int32_t((E + 7) / 8 * 8) : int32_t(E);
  a.hist = ws.data;
  a.map = static_cast<int32_t*>(map.data);
  a.map_s0 = map.stride[0];
  a.map_s1 = map.stride[1];
  a.counts = static_cast<int64_t*>(counts.data);
  a.counts_s = counts.stride[0];
  a.d2s = static_cast<int32_t*>(d2s.data);
  a.d2s_s = d2s.ndim ? d2s.stride[0] : 1;
  // Keep the two kernels' shared memory alike: with 32 KB more in the rank kernel alone, its blocks no
  // longer shared an SM with the count kernel's (another shared-memory configuration), the PDL overlap
  // was lost and a plan took up to 3.4 us more (H100, 2026-12-06 10:51; docs/benchmarks.md).
  const size_t smem_count = size_t(kPlanWarps) * E * 4, smem_rank = size_t(kPlanWarps + 2) * E * 4;
  const PlanMode mode = plan_mode();
  auto go = [&](auto two) {
    constexpr bool kTwo = decltype(two)::value;
    const void* fused = reinterpret_cast<const void*>(&moe_plan_kernel<kTwo>);
    const void* rank = reinterpret_cast<const void*>(&moe_rank_kernel<kTwo>);
    set_smem(fused, smem_rank);
    // auto: on sm_90+ the two kernels with PDL where the rank kernel's recount is one tile a warp,
    // else the cooperative kernel where its blocks fit at once, else the two kernels (PDL on sm_90+).
    // Measured on an H100 (2026-12-05 ~18:02 UTC, us, PDL / cooperative / two in stream order):
    // T*K 16K-64K (one tile a warp) 7.1-9.0 / 7.2-9.5 / 9.2-12.0; top-8 of 64 at T*K 512K (4 tiles a
    // warp) 27.9 / 24.8 / 31.7. The count kernel a dependent launch too (H100, 2026-12-06 ~11:40 UTC, us
    // a plan, 20 in a CUDA graph / each behind a one-element add_, before / after): two experts T64k
    // 4.65 / 4.76 -> 3.90 / 4.48, top-2 of 8 T32k 5.35 / 5.41 -> 4.64 / 5.12, top-2 of 64 T32k
    // 6.14 / 6.22 -> 5.46 / 5.94, top-8 of 64 T8k dropped 5.92 / 6.29 -> 6.04 / 6.01. The cooperative
    // kernel as a programmatic dependent launch lost at one tile a warp and tied behind an add_ beyond
    // (H100, 2026-12-06 18:52 UTC, same measure, auto vs it): top-2 of 64 T32k 5.49 / 5.83 vs
    // 5.62 / 6.45, top-2 of 8 T32k 4.65 / 5.16 vs 4.89 / 5.71, top-8 of 64 T64k 21.27 / 21.30 vs
    // 20.70 / 21.33 (docs/benchmarks.md).
    const bool sm90 = cuda::kernel_arch(rank) >= 90, one_tile = a.per_block <= kPlanThreads * kPlanItems;
    const bool fits = a.C <= resident_blocks(fused, smem_rank);
    const bool coop =
        mode == PlanMode::kCooperative ? fits : mode == PlanMode::kAuto && fits && !(sm90 && one_tile);
    const bool pdl = !coop && mode == PlanMode::kAuto && sm90;
    if (coop) {
      void* args[] = {&a};  // one launch: count, grid barrier, rank
      MMFUSE_CUDA_CHECK(cudaLaunchCooperativeKernel(fused, dim3(unsigned(a.C)), dim3(kPlanThreads), args, smem_rank,
                                                    stream));
      MMFUSE_CUDA_CHECK_LAUNCH("moe_plan_kernel");
      return;
    }
    set_smem(reinterpret_cast<const void*>(&moe_count_kernel<kTwo>), smem_count);
    set_smem(rank, smem_rank);
    {
      const DependentLaunch launch(dim3(unsigned(a.C)), dim3(kPlanThreads), smem_count, stream, pdl);
      MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, &moe_count_kernel<kTwo>, a));
      MMFUSE_CUDA_CHECK_LAUNCH("moe_count_kernel");
    }
    const DependentLaunch launch(dim3(unsigned(a.C)), dim3(kPlanThreads), smem_rank, stream, pdl);
    MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, &moe_rank_kernel<kTwo>, a));
    MMFUSE_CUDA_CHECK_LAUNCH("moe_rank_kernel");
  };
  if (E <= 2)
    go(std::true_type{});
  else
    go(std::false_type{});
}

void moe_permute_cuda(const TensorView& x, const TensorView& map, TensorView& out, cudaStream_t stream) {
  const int64_t T = x.shape[0], H = x.shape[1], K = map.shape[0], N = out.shape[0];
  const int64_t es = int64_t(dtype_size(x.dtype)), row = H * es;
  if (T == 0 || H == 0 || K == 0) return;
  const int b = vec_bytes(row, {{x.data, x.stride[0] * es}, {out.data, out.stride[0] * es}});
  const uint32_t V = uint32_t(row / b);
  const bool small = T * V < (int64_t(1) << 31);
  dispatch_vec(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    // The map entries of two k a step at K >= 2: H200 2026-12-04 ~17:35 UTC, % of copy, top-2 of 8 T16k
    // H4096 88.2 vs 86.9 (one k), top-8 of 64 T64k H2048 85.4 vs 85.1; four or eight k a step
    // lost (registers: 75 and 99 vs 62; top-2 at eight: 68.8).
    // A block for every 1024 vectors, not a grid-stride loop over 16 blocks an SM; streaming stores
    // at K >= 4. Measured on an H100 (2026-12-06 ~06:15 UTC, % of copy, mean of two runs; 16 blocks
    // an SM / a block for all / 32 an SM / a block for all with streaming stores): top-2 of 8 T16k
    // H4096 92.8 / 95.2 / 93.9, T32k H2048 92.8 / 95.2 / 93.9; top-2 of 64 T32k H2048 92.0 / 93.2;
    // two experts T16k H2048 91.5 / 91.8, T64k H2048 95.7 / 98.2; top-8 of 64 T64k H2048 89.6 /
    // 91.7 / 90.0 / 92.5, T8k H4096 10 % dropped 89.5 / 91.5 / 91.5 / 92.5 (streaming stores at
    // K <= 2: 0.1-0.5 lower). Two or eight vectors a thread instead of four: the same or up to 1
    // point lower.
    auto go = [&](auto kgc, auto csc) {
      constexpr int KG = decltype(kgc)::value;
      constexpr bool CS = decltype(csc)::value;
      auto kernel = small ? &moe_permute_kernel<B, true, KG, CS> : &moe_permute_kernel<B, false, KG, CS>;
      kernel<<<flat_blocks(T * V, kPermUnroll, true), kFlatThreads, 0, stream>>>(
          static_cast<const char*>(x.data), x.stride[0] * es, static_cast<char*>(out.data), out.stride[0] * es, N,
          map_ref(map), T, K, V, FastDiv(V));
    };
    if (K >= 4)
      go(std::integral_constant<int, 2>{}, std::true_type{});
    else if (K >= 2)
      go(std::integral_constant<int, 2>{}, std::false_type{});
    else
      go(std::integral_constant<int, 1>{}, std::false_type{});
    MMFUSE_CUDA_CHECK_LAUNCH("moe_permute_kernel");
  });
}

// Calls f(TypeTag<S>, VEC) with the widest vector of S that the rows allow.
template <class F>
void dispatch_rows(DType dt, const char* what, int64_t H, std::initializer_list<std::pair<const void*, int64_t>> rows,
                   F&& f) {
  dispatch_floating(dt, what, [&](auto tag) {
    using S = typename std::decay_t<decltype(tag)>::type;
    using D = typename device_type<S>::type;
    const int b = std::max<int>(vec_bytes(H * int64_t(sizeof(S)), rows), int(sizeof(S)));
    dispatch_vec(b, [&](auto bc) {
      constexpr int VEC = decltype(bc)::value / int(sizeof(S));
      if constexpr (VEC >= 1) f(TypeTag<D>{}, std::integral_constant<int, VEC>{});
    });
  });
}

// MMFUSE_MOE_UNPERMUTE, the grid of the warp-a-token unpermute (K <= 2), for tests and measurements:
// auto (unset: token), resident (the warps resident at once, each walking tokens) or token (a warp
// for every token, a block for every kRowWarps tokens).
enum class UnpermuteLaunch { kAuto, kResident, kToken };
UnpermuteLaunch unpermute_launch() {
  return UnpermuteLaunch(env_choice("moe_unpermute", "MMFUSE_MOE_UNPERMUTE", {"auto", "resident", "token"}));
}

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
                  if (K <= 2) {
                    // A warp a token (K = 0: zeros): at K = 1, 8 vectors a lane at a time (4 for rows under 256
                    // vectors); at K = 2, 4 vectors of each row. Measured on the H200 (2026-12-04, %
                    // of copy, vs the token-tile path), K = 1 (~17:25 UTC): two experts T16k H2048
                    // 83.4 vs 74.2, H4096 86.9 vs 71.4, top-1 of 8 82.6 vs 74.6, 10 % dropped 80.5 vs
                    // 77.3, T64k H1024 86.0 (4 a lane; 8: 77.6) vs 54.4; K = 2 (~18:53): top-2 of 8
                    // T16k H4096 92.0 vs 79.6, H2048 86.7 vs 73.5, H7168 93.6 vs 82.8, T32k H1024
                    // 83.2 vs 71.5, H4096 10 % dropped 88.9 vs 74.8.
                    // A warp for every token (the hardware hands out the blocks), not only the resident
                    // warps each walking tokens. Measured on an H100 (2026-12-06 ~16:49 UTC, % of copy,
                    // resident / a warp a token, three rounds in one process with the benchmark's arena,
                    // every output equal): two experts T16k H2048 85.2-86.0 / 87.2-87.6, T64k H2048
                    // 92.2-92.5 / 94.5-94.7, T16k H4096 87.8-88.1 / 92.8; top-2 of 8 T16k H4096
                    // 93.3-93.7 / 95.0-95.1; top-1 of 8 T16k H2048 86.0-86.8 / 87.6-87.7. (Streaming
                    // stores, streaming loads and 4 vectors a lane at K = 1, each on the resident grid,
                    // gained less or lost: docs/benchmarks.md.) Earlier H100 runs agreed (~06:15, ~07:41:
                    // two experts T16k H2048 86.4 / 88.0 and 86.6 / 87.2, top-2 of 8 T16k H4096 91.8 /
                    // 94.1 and 93.4 / 95.5). On the H200 (~06:36) the cases it changed read below the
                    // resident kernel's figures of 03:07 (two experts T16k H2048 77.8 vs 80.3, top-2 of
                    // 8 T16k H4096 88.6 vs 92.0) in a run whose buffers may have sat in slow memory
                    // (docs/benchmarks.md 07:39); an H200 A/B in one process is still owed, and the
                    // benchmark's sweep prints it (MMFUSE_MOE_UNPERMUTE=resident).
                    const bool token = unpermute_launch() != UnpermuteLaunch::kResident;
                    auto go = [&](auto kgc, auto chc) {
                      constexpr int KG = decltype(kgc)::value, CH = decltype(chc)::value;
                      auto kernel = &moe_unpermute_warp_kernel<D, VEC, KG, CH>;
                      kernel<<<row_blocks(reinterpret_cast<const void*>(kernel), T, token), kRowThreads, 0,
                               stream>>>(
                          static_cast<const D*>(y.data), y.stride[0], N, static_cast<D*>(out.data), out.stride[0],
                          map_ref(map), p, p ? probs.stride[0] : 0, p ? probs.stride[1] : 0, T, K, V);
                    };
                    if (K == 2)
                      go(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
                    else if (V >= 256)
                      go(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{});
                    else
                      go(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{});
                    MMFUSE_CUDA_CHECK_LAUNCH("moe_unpermute_warp_kernel");
                    return;
                  }
                  if constexpr (kTileType<D, VEC>) {
                    // K >= 3. Measured on the H200 (2026-12-04 UTC, % of copy, the tile path vs the
                    // general kernel): top-8 of 64 T64k H2048 97.7 vs 67.8 (04:26); with two producer
                    // warps 99.2 (14:17).
                    TileArgs ta = tile_args(y, map, probs, out);
                    ta.stage_bytes = ta.K * ta.row_bytes;
                    ta.stage_y = true;
                    if (tile_launch(reinterpret_cast<const void*>(&moe_unpermute_tile_kernel<D>),
                                    "moe_unpermute_tile_kernel", 1, ta, stream))
                      return;
                  }
                  // The general kernel (K >= 3 where the tile path does not apply): one vector a thread,
                  // two rows a step. Measured on the H200 (2026-12-03 ~12:07 UTC): more in flight a
                  // thread costs registers and loses (top-8: 2 rows 65 %, 4 rows 50 %, 8 rows 23 % of copy)
                  auto kernel = T * V < (int64_t(1) << 31) ? &moe_unpermute_kernel<D, VEC, 2, 1, true>
                                                           : &moe_unpermute_kernel<D, VEC, 2, 1, false>;
                  kernel<<<flat_blocks(T * V, 1), kFlatThreads, 0, stream>>>(
                      static_cast<const D*>(y.data), y.stride[0], N, static_cast<D*>(out.data), out.stride[0],
                      map_ref(map), p, p ? probs.stride[0] : 0, p ? probs.stride[1] : 0, T, K, V, FastDiv(V));
                  MMFUSE_CUDA_CHECK_LAUNCH("moe_unpermute_kernel");
                });
}

// MMFUSE_MOE_BWD, the backward's path, for tests and measurements: auto (unset: a warp a token at
// K = 1, a warp an entry at K = 2; at K >= 3 the token-tile kernel where it applies, else a warp an
// entry; the general kernel where T * K >= 2^31), tile (the token-tile kernel where it applies, else
// the general kernel), general (the block kernel), warp (a warp a token at K <= 8, else as auto) or
// entry (a warp an entry where T * K < 2^31, else as auto).
enum class BwdPath { kAuto, kTile, kGeneral, kWarp, kEntry };
BwdPath bwd_path() {
  return BwdPath(env_choice("moe_unpermute_backward", "MMFUSE_MOE_BWD", {"auto", "tile", "general", "warp", "entry"}));
}

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
  dispatch_rows(
      y.dtype, "moe_unpermute_backward: y", H,
      {{y.data, y.stride[0] * es}, {dout.data, dout.stride[0] * es}, {dy.data, dy.stride[0] * es}},
      [&](auto tag, auto vc) {
        using D = typename std::decay_t<decltype(tag)>::type;
        constexpr int VEC = std::decay_t<decltype(vc)>::value;
        const uint32_t V = uint32_t(H / VEC);
        const float* p = static_cast<const float*>(probs.data);
        float* dp = static_cast<float*>(dprobs.data);
        auto zero_unwritten = [&] {  // the rows of dy no entry maps to; rows two entries map to: an error
          if (N == 0) return;
          constexpr int B = VEC * int(sizeof(D));
          const unsigned grid = unsigned(std::min<int64_t>((N + 255) / 256, int64_t(1) << 20));
          // a programmatic dependent launch on sm_90+: its launch overlaps the row kernel's last
          // blocks. Measured on an H100 (2026-12-06 ~04:37 UTC, % of copy, stream order vs PDL):
          // two experts T16k H2048 83.7 vs 85.4, H4096 90.7 vs 91.9; top-2 of 8 T16k H4096 92.4 vs
          // 93.3; top-2 of 64 T32k H2048 91.6 vs 92.5; top-8 of 64 T64k H2048 93.7 vs 93.7. (Two
          // experts T16k H2048: the row kernel 72.6 us, this kernel 1.7, the memset that cleared
          // its bitmap then 1.2; the whole op 79.3, event-timed.)
          auto kernel = &moe_zero_rows_kernel<B>;
          const DependentLaunch launch(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(256), 0, stream);
          MMFUSE_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, static_cast<const uint32_t*>(writes),
                                               static_cast<char*>(dy.data), dy.stride[0] * es, N, V));
          MMFUSE_CUDA_CHECK_LAUNCH("moe_zero_rows_kernel");
        };
        // The warp-walk kernels (rows in flight in registers, no shared memory): a warp a token with
        // all its rows, or (`entry`) a warp an entry.
        // A warp a token: 4 vectors of dout and of the row a lane at a time at K = 1, 2 of dout and of
        // each row at K = 2. Measured on an H100 (2026-12-05 ~17:43 UTC, % of copy; warp kernel with
        // 4 / 2 / 8 vectors a lane at K = 1 vs the token-tile kernel): two experts T16k H2048 83.8 /
        // 83.0 / 77.9 vs 73.6, T64k H2048 93.1 / 94.5 / 86.3 vs 83.5, T16k H4096 89.6 / 87.1 / 84.7
        // vs 81.0; at K = 2 (2 / 4 a lane vs tile): top-2 of 8 T16k H4096 91.5 / 79.6 vs 85.8, T32k
        // H2048 92.1 / 79.2 vs 85.5, top-2 of 64 T32k H2048 90.5 / 78.4 vs 85.9 (4 a lane at K = 2:
        // 154 registers; 8: spills).
        // Resident warps walking tokens: a warp a token (a block for every 8 tokens) lost on an
        // H100 (2026-12-06 ~06:11 UTC, % of copy, mean of two runs): two experts T16k H2048 85.6
        // vs 82.6, T64k H2048 94.6 vs 90.2, top-2 of 8 T32k H2048 93.8 vs 91.6; and on the H200
        // with the counts as reductions (~06:37): two experts T16k H2048 81.7 vs 77.2, T64k 92.8
        // vs 86.5.
        // A programmatic dependent launch of moe_clear_kernel on sm_90+. Measured on the H200
        // (2026-12-06 ~06:37 UTC, % of copy, mean of two runs; counts as reductions, stream order /
        // PDL): two experts T16k H2048 81.7 / 81.7, T64k H2048 92.8 / 93.1, T16k H4096 89.3 /
        // 89.5, T32k H1024 77.7 / 78.8; top-2 of 8 T16k H2048 79.9 / 80.4.
        auto by_warps = [&](bool entry) {
          auto go = [&](auto kgc, auto chc, auto ec) {
            constexpr int KG = decltype(kgc)::value, CH = decltype(chc)::value;
            constexpr bool kEntry = decltype(ec)::value;
            auto kernel = &moe_unpermute_bwd_warp_kernel<D, VEC, KG, CH, kEntry>;
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
          using I = std::integral_constant<int, 1>;
          if (entry)
            go(I{}, std::integral_constant<int, 4>{}, std::true_type{});
          else if (K == 1)
            go(I{}, std::integral_constant<int, 4>{}, std::false_type{});
          else if (K == 2)
            go(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{}, std::false_type{});
          else if (K <= 4)
            go(std::integral_constant<int, 4>{}, I{}, std::false_type{});
          else
            go(std::integral_constant<int, 8>{}, I{}, std::false_type{});
          zero_unwritten();
        };
        // K = 3..8 with MMFUSE_MOE_BWD=warp: 4 or 8 rows a token, a vector of each a lane at a time.
        // Measured on an H100 (2026-12-06 ~07:41 UTC, % of copy, against auto's tile or general
        // kernel): top-4 of 16 T16k H4096 92.2 vs 86.2; but top-8 of 64 T64k H2048 81.2 vs 92.4, T8k
        // H4096 10 % dropped 77.3 vs 89.0 (8 rows a lane: 143 registers, a block an SM).
        // A warp an entry (4 vectors of dout and of the row a lane at a time) at K = 2, and at K >= 3
        // where the tile kernel does not apply. Measured on an H100 (2026-12-06 ~08:40 UTC, % of copy,
        // entry vs the warp a token at K = 2, vs the tile kernel or the general kernel at K = 8):
        // top-2 of 8 T16k H4096 94.6 vs 93.3, T32k H2048 95.0 vs 93.6; top-2 of 64 T32k H2048 93.2
        // vs 92.3; top-8 of 64 T8k H4096 10 % dropped 91.6 vs 88.5 (general; the tile kernel does
        // not take its 72 KB tokens); top-8 of 64 T64k H2048 91.8 vs 92.2 (tile). At K = 1 it is the
        // warp a token's kernel (88.5 / 95.3 / 90.8 vs 88.8 / 95.5 / 91.4 for two experts).
        const BwdPath path = bwd_path();
        const bool entry_ok = K >= 1 && T * K < (int64_t(1) << 31);
        if (entry_ok && (path == BwdPath::kEntry || (path == BwdPath::kAuto && K == 2))) return by_warps(true);
        if (K >= 1 && ((K == 1 && path == BwdPath::kAuto) || (K <= 8 && path == BwdPath::kWarp)))
          return by_warps(false);
        bool tiled = false;
        if constexpr (kTileType<D, VEC>) {
          TileArgs ta = tile_args(y, map, probs, dy);
          ta.g = static_cast<const char*>(dout.data);
          ta.gs = dout.stride[0] * es;
          ta.dprobs = dp;
          ta.dps0 = dp ? dprobs.stride[0] : 0;
          ta.dps1 = dp ? dprobs.stride[1] : 0;
          ta.writes = writes;
          ta.stage_y = dp != nullptr;
          ta.stage_bytes = (1 + (dp ? ta.K : 0)) * ta.row_bytes;
          // Tokens of up to 48 KB (four stages in the budget, a warp each). Measured on the H200
          // (2026-12-04 UTC, % of copy, tile path vs the general kernel): 24 KB 83.0 vs 79.9, 36 KB
          // 90.4 vs 72.7 (06:01, 11:37), top-1 at H2048 (8 KB) 75.5 vs 59.5 with two producer warps
          // (13:59; 45.5 with one); but 72 KB (top-8 at H4096: three stages, three warps) 71.5 vs
          // 78.1 (06:01).
          if (ta.stage_bytes <= 48 * 1024 && path != BwdPath::kGeneral)
            tiled = tile_launch(reinterpret_cast<const void*>(&moe_unpermute_bwd_tile_kernel<D>),
                                "moe_unpermute_bwd_tile_kernel", kTileConsumers, ta, stream);
        }
        if (!tiled && entry_ok && path == BwdPath::kAuto) return by_warps(true);
        if (T > 0 && K > 0 && !tiled) {
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
