#pragma once

#include "cuda/moe/common.cuh"
#include "cuda/tma.cuh"

namespace mmfuse {
namespace detail {
namespace {

// The token-tile kernels (sm_90+) of unpermute and its backward: the shared producer/consumer
// machinery; the shape rule is tile_shape in path.h.
//
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
constexpr int kTileThreads = 32 * (kTileConsumers + kTileMaxProducers);  // the most a block launches

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
static_assert(kTileStageExtra == sizeof(TileMeta) + 16, "path.h's kTileStageExtra: a stage's slot and barriers");

// Shared memory of a tile kernel: the stages, their slots, then their full and empty barriers.
inline size_t tile_smem(int stage_bytes, int stages) {
  return size_t(stages) * (size_t(stage_bytes) + size_t(kTileStageExtra));
}

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

// Launches the token-tile kernel `fn` with the shape tile_shape chose (s.stages > 0); `a` has all
// but the launch shape.
inline void tile_launch(const void* fn, const char* name, const TileShape& s, TileArgs a, cudaStream_t stream) {
  a.seqs = s.seqs;
  a.stages = s.stages;
  a.producers = s.producers;
  const int threads = 32 * (kTileConsumers + a.producers);
  const size_t smem = tile_smem(a.stage_bytes, a.stages);
  set_smem(fn, smem);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(a.T, cuda::resident_blocks(fn, threads, smem)));
  a.per_block = (a.T + grid - 1) / grid;
  void* args[] = {&a};
  MMFUSE_CUDA_CHECK(cudaLaunchKernel(fn, dim3(unsigned((a.T + a.per_block - 1) / a.per_block)), dim3(threads),
                                     args, smem, stream));
  MMFUSE_CUDA_CHECK_LAUNCH(name);
}

// The shape for `a` (its K, T, row_bytes and stage_bytes set) of the tile kernel fn.
inline TileShape tile_shape_for(const void* fn, const TileArgs& a, int max_seqs) {
  return tile_shape(cuda::kernel_arch(fn), a.K, a.T, a.row_bytes, a.stage_bytes, max_seqs);
}

// Types the tile kernels take: 16-byte vectors of a 16- or 32-bit type.
template <class D, int VEC>
constexpr bool kTileType = sizeof(D) <= 4 && VEC * sizeof(D) == 16;

// The fields of the tile paths that unpermute and its backward share.
inline TileArgs tile_args(const TensorView& y, const TensorView& map, const TensorView& probs, TensorView& out) {
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
}  // namespace detail
}  // namespace mmfuse
