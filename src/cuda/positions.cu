// CUDA backend of the position family.
//
// rope_index: one block per row, the row in tiles of kThreads * kItems tokens, four block scans a
// tile (the previous valid token and the compact index; the span count per kind; the latest span
// opening; the position increments), with the running values carried from tile to tile. A token's
// position is then a closed form of its scans: text gets the running sum of increments (1 a text
// token; a span's first token adds the span's extent), a span token its span's base plus (T, row,
// col). A first launch counts each row's spans so that a row knows its first grid (grids are
// consumed across the batch). No host sync, no atomics, deterministic.
//
// Vision: one single-block launch turns the grids into prefix sums (merged tokens, windows, frames,
// patches) in the workspace, checking them against the sizes the host computed; then one thread per
// output element finds its grid by binary search and writes a closed form.
#include <cuda_runtime.h>

#include <cassert>
#include <cstdio>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/cuda_check.h"
#include "cuda/device_util.cuh"
#include "backends/positions.h"
#include "mmfuse/positions.h"

namespace mmfuse {
namespace detail {
namespace {

constexpr int kThreads = 512, kItems = 4, kTile = kThreads * kItems;

using cuda::IndexRef;
IndexRef ref(const TensorView& v) { return cuda::index_ref(v); }

struct RopeIndexArgs {
  IndexRef ids, mask, types, grid[2];
  int64_t n_grid[2];
  const float* sec;
  int64_t sec_s;
  int64_t* pos;
  int64_t pos_s[3];
  int64_t* deltas;
  int64_t deltas_s;
  int32_t* counts;  // [B][2]: image and video spans of each row
  int64_t B, L;
  RopeIndexParams p;
  bool has_mask, hf5, tps_integral;
};

// ---- scan payloads ----
struct Prev {  // rightmost valid token, and the count of valid tokens
  int64_t tok;
  int32_t has, cnt;
};
struct PrevOp {
  __device__ Prev operator()(const Prev& a, const Prev& b) const {
    return {b.has ? b.tok : a.tok, a.has | b.has, a.cnt + b.cnt};
  }
};
struct Kinds {
  int32_t img, vid;
};
struct KindsOp {
  __device__ Kinds operator()(const Kinds& a, const Kinds& b) const { return {a.img + b.img, a.vid + b.vid}; }
};
struct Open {  // the latest span opening: its compact index, kind (0: none) and grid
  int32_t c, kind;
  int64_t g;
};
struct OpenOp {
  __device__ Open operator()(const Open& a, const Open& b) const { return b.kind ? b : a; }
};

struct MaxOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

struct Span {
  int64_t t, hm, wm, len, extent;  // extent: what the span adds to the running position
  float sec;
};

__device__ int64_t time_index(const RopeIndexArgs& a, int64_t frame, float sec) {
  const float tps = a.p.tokens_per_second;
  if (a.p.mode == RopeIndexMode::kQwen) return int64_t(__fmul_rn(__fmul_rn(float(frame), sec), tps));
  const int64_t whole = int64_t(sec);
  if (a.hf5) {
    if (a.tps_integral) return frame * whole * int64_t(tps);
    return int64_t(__fmul_rn(float(frame), float(double(tps) * double(whole))));
  }
  return int64_t(__fmul_rn(float(frame * whole), tps));
}

__device__ Span span_of(const RopeIndexArgs& a, int kind, int64_t g, int64_t row) {
  const IndexRef& G = a.grid[kind - 1];
  const int m = a.p.spatial_merge_size;
  const int64_t t = G(g, 0), h = G(g, 1), w = G(g, 2);
  if (!(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0))
    MMFUSE_DEVICE_FAIL("rope_index: row %lld: %s_grid_thw[%lld] = (%lld, %lld, %lld): expected positive t, h, w "
                       "with h and w divisible by spatial_merge_size %d",
                       (long long)row, kind == 1 ? "image" : "video", (long long)g, (long long)t, (long long)h,
                       (long long)w, m);
  Span s;
  s.t = t;
  s.hm = h / m;
  s.wm = w / m;
  s.len = t * s.hm * s.wm;
  s.sec = kind == 1 ? 0.0f : (a.sec ? a.sec[g * a.sec_s] : 1.0f);
  if (!(s.sec >= 0.0f && s.sec < 2147483648.0f))  // NaN fails too
    MMFUSE_DEVICE_FAIL("rope_index: row %lld: second_per_grid_ts[%lld] = %g: expected a finite value in [0, 2^31)",
                       (long long)row, (long long)g, double(s.sec));
  if (a.hf5) {
    s.extent = max(s.hm, s.wm);
  } else {
    const int64_t T = kind == 1 ? 0 : time_index(a, t - 1, s.sec);
    s.extent = max(max(T, int64_t(0)), max(s.hm, s.wm) - 1) + 1;
  }
  return s;
}

union RopeIndexTemp {
  typename cub::BlockScan<Prev, kThreads>::TempStorage prev;
  typename cub::BlockScan<Kinds, kThreads>::TempStorage kinds;
  typename cub::BlockScan<Open, kThreads>::TempStorage open;
  typename cub::BlockScan<int64_t, kThreads>::TempStorage sum;
  typename cub::BlockReduce<int64_t, kThreads>::TempStorage max;
  typename cub::BlockReduce<Kinds, kThreads>::TempStorage kreduce;
};

// kCount: only count each row's spans into a.counts. Otherwise: the full pass.
template <bool kCount>
__global__ void __launch_bounds__(kThreads) rope_index_kernel(RopeIndexArgs a) {
  __shared__ RopeIndexTemp temp;
  const int64_t b = blockIdx.x;
  const RopeIndexParams& p = a.p;
  const int64_t pad = a.hf5 ? 0 : 1;
  // this row's first grids: the spans of the rows before it
  Kinds first{0, 0};
  if constexpr (!kCount) {
    Kinds mine{0, 0};
    for (int64_t r = threadIdx.x; r < b; r += kThreads) {
      mine.img += a.counts[2 * r];
      mine.vid += a.counts[2 * r + 1];
    }
    first = cub::BlockReduce<Kinds, kThreads>(temp.kreduce).Reduce(mine, KindsOp());
    __shared__ Kinds first_s;
    if (threadIdx.x == 0) first_s = first;
    __syncthreads();
    first = first_s;
  }
  Prev prev_carry{0, 0, 0};
  Kinds kind_carry{0, 0};
  Open open_carry{0, 0, 0};
  int64_t sum_carry = 0, row_max = -1, ends = 0;
  for (int64_t base = 0; base < a.L; base += kTile) {
    int64_t tok[kItems], id[kItems];
    bool valid[kItems];
    Prev pv[kItems];
    for (int i = 0; i < kItems; ++i) {
      const int64_t l = base + threadIdx.x * kItems + i;
      valid[i] = false;
      tok[i] = id[i] = 0;
      if (l < a.L) {
        const int64_t mv = a.has_mask ? a.mask(b, l) : 1;
        valid[i] = a.hf5 ? mv != 0 : mv == 1;
        id[i] = a.ids(b, l);
        tok[i] = a.hf5 ? a.types(b, l) : id[i];
      }
      pv[i] = {tok[i], int32_t(valid[i]), int32_t(valid[i])};
    }
    Prev agg;
    cub::BlockScan<Prev, kThreads>(temp.prev).ExclusiveScan(pv, pv, Prev{0, 0, 0}, PrevOp(), agg);
    __syncthreads();
    int kind[kItems];
    Kinds kv[kItems];
    for (int i = 0; i < kItems; ++i) {
      const Prev before = PrevOp()(prev_carry, pv[i]);
      pv[i] = before;
      kind[i] = 0;
      if (valid[i]) {
        if (a.hf5) {
          if (tok[i] < 0 || tok[i] > 2)
            MMFUSE_DEVICE_FAIL("rope_index: row %lld: mm_token_type_ids: expected 0, 1 or 2, got %lld at token %lld",
                               (long long)b, (long long)tok[i], (long long)(base + threadIdx.x * kItems + i));
          if (tok[i] != 0 && !(before.has && before.tok == tok[i])) kind[i] = int(tok[i]);
        } else if (before.has && before.tok == p.vision_start_token_id) {
          kind[i] = tok[i] == p.image_token_id ? 1 : (tok[i] == p.video_token_id ? 2 : 0);
        }
      }
      kv[i] = {kind[i] == 1, kind[i] == 2};
    }
    prev_carry = PrevOp()(prev_carry, agg);
    Kinds kagg;
    cub::BlockScan<Kinds, kThreads>(temp.kinds).ExclusiveScan(kv, kv, Kinds{0, 0}, KindsOp(), kagg);
    __syncthreads();
    if constexpr (kCount) {
      kind_carry = KindsOp()(kind_carry, kagg);
    } else {
      Open ov[kItems];
      for (int i = 0; i < kItems; ++i) {
        ov[i] = {pv[i].cnt, 0, 0};
        if (!kind[i]) continue;
        const Kinds k = KindsOp()(KindsOp()(first, kind_carry), kv[i]);
        const int64_t g = kind[i] == 1 ? k.img : k.vid;
        if (g >= a.n_grid[kind[i] - 1])
          MMFUSE_DEVICE_FAIL("rope_index: row %lld: more %s spans than %s_grid_thw rows (%lld)", (long long)b,
                             kind[i] == 1 ? "image" : "video", kind[i] == 1 ? "image" : "video",
                             (long long)a.n_grid[kind[i] - 1]);
        ov[i] = {pv[i].cnt, kind[i], g};
      }
      kind_carry = KindsOp()(kind_carry, kagg);
      Open oagg;
      cub::BlockScan<Open, kThreads>(temp.open).InclusiveScan(ov, ov, OpenOp(), oagg);
      __syncthreads();
      int64_t d[kItems];
      for (int i = 0; i < kItems; ++i) {
        ov[i] = OpenOp()(open_carry, ov[i]);
        d[i] = 0;
        if (!valid[i]) continue;
        d[i] = 1;
        if (!ov[i].kind) continue;
        const Span s = span_of(a, ov[i].kind, ov[i].g, b);
        const int64_t o = int64_t(pv[i].cnt) - ov[i].c;  // offset in the latest span
        const bool member = a.hf5 ? tok[i] != 0 : o < s.len;
        if (!member) continue;
        if (a.hf5 && o >= s.len)
          MMFUSE_DEVICE_FAIL("rope_index: row %lld: the %s run at valid token %d is longer than its grid's %lld tokens",
                             (long long)b, ov[i].kind == 1 ? "image" : "video", ov[i].c, (long long)s.len);
        if (!a.hf5 && id[i] != (ov[i].kind == 1 ? p.image_token_id : p.video_token_id))
          MMFUSE_DEVICE_FAIL("rope_index: row %lld: the %s span at valid token %d should have %lld tokens, but valid "
                             "token %lld is not an %s token",
                             (long long)b, ov[i].kind == 1 ? "image" : "video", ov[i].c, (long long)s.len,
                             (long long)pv[i].cnt, ov[i].kind == 1 ? "image" : "video");
        ends += o == s.len - 1;
        d[i] = o == 0 ? s.extent : 0;
      }
      open_carry = OpenOp()(open_carry, oagg);
      int64_t dagg;
      cub::BlockScan<int64_t, kThreads>(temp.sum).ExclusiveSum(d, d, dagg);
      __syncthreads();
      for (int i = 0; i < kItems; ++i) {
        const int64_t l = base + threadIdx.x * kItems + i;
        if (l >= a.L) break;
        int64_t v[3] = {pad, pad, pad};
        if (valid[i]) {
          const int64_t at = sum_carry + d[i];
          v[0] = v[1] = v[2] = at;
          if (ov[i].kind) {
            const Span s = span_of(a, ov[i].kind, ov[i].g, b);
            const int64_t o = int64_t(pv[i].cnt) - ov[i].c;
            if (a.hf5 ? tok[i] != 0 : o < s.len) {
              const int64_t span_base = o == 0 ? at : at - s.extent;
              const int64_t area = s.hm * s.wm, f = o / area, r = (o % area) / s.wm, c = o % s.wm;
              const int64_t T = a.hf5 ? (ov[i].kind == 1 ? f : time_index(a, f, s.sec))
                                      : (ov[i].kind == 1 ? 0 : time_index(a, f, s.sec));
              v[0] = span_base + T;
              v[1] = span_base + r;
              v[2] = span_base + c;
            }
          }
          row_max = max(row_max, max(v[0], max(v[1], v[2])));
        }
        for (int ax = 0; ax < 3; ++ax) a.pos[ax * a.pos_s[0] + b * a.pos_s[1] + l * a.pos_s[2]] = v[ax];
      }
      sum_carry += dagg;
    }
  }
  if constexpr (kCount) {
    if (threadIdx.x == 0) {
      a.counts[2 * b] = kind_carry.img;
      a.counts[2 * b + 1] = kind_carry.vid;
    }
    return;
  }
  // every span ended inside the row; no vision start as the last valid token (qwen / hf4)
  const int64_t all_ends = cub::BlockReduce<int64_t, kThreads>(temp.max).Sum(ends);
  __syncthreads();
  const int64_t mx = cub::BlockReduce<int64_t, kThreads>(temp.max).Reduce(row_max, MaxOp());
  if (threadIdx.x == 0) {
    const int64_t opens = kind_carry.img + kind_carry.vid;
    if (all_ends != opens)
      MMFUSE_DEVICE_FAIL("rope_index: row %lld: a %s (valid token %d) is shorter than its grid (its tokens run past "
                         "the row or into the next span)",
                         (long long)b, a.hf5 ? "vision run" : "vision span", open_carry.c);
    if (!a.hf5 && prev_carry.has && prev_carry.tok == p.vision_start_token_id)
      MMFUSE_DEVICE_FAIL("rope_index: row %lld: a vision start token is the last valid token", (long long)b);
    const int64_t n = prev_carry.cnt;
    a.deltas[b * a.deltas_s] = n == 0 ? 0 : mx + 1 - (a.hf5 ? n : a.L);
  }
}

}  // namespace

void rope_index_cuda(const RopeIndexInputs& in, const RopeIndexParams& p, TensorView& pos, TensorView& deltas,
                     TensorView& ws, cudaStream_t stream) {
  RopeIndexArgs a{};
  a.ids = ref(in.input_ids);
  a.mask = ref(in.attention_mask);
  a.types = ref(in.mm_token_type_ids);
  a.grid[0] = ref(in.image_grid_thw);
  a.grid[1] = ref(in.video_grid_thw);
  a.n_grid[0] = in.image_grid_thw.defined() ? in.image_grid_thw.shape[0] : 0;
  a.n_grid[1] = in.video_grid_thw.defined() ? in.video_grid_thw.shape[0] : 0;
  a.sec = in.second_per_grid_ts.defined() ? static_cast<const float*>(in.second_per_grid_ts.data) : nullptr;
  a.sec_s = in.second_per_grid_ts.defined() ? in.second_per_grid_ts.stride[0] : 0;
  a.pos = static_cast<int64_t*>(pos.data);
  for (int i = 0; i < 3; ++i) a.pos_s[i] = pos.stride[i];
  a.deltas = static_cast<int64_t*>(deltas.data);
  a.deltas_s = deltas.stride[0];
  a.counts = static_cast<int32_t*>(ws.data);
  a.B = in.input_ids.shape[0];
  a.L = in.input_ids.shape[1];
  a.p = p;
  a.has_mask = in.attention_mask.defined();
  a.hf5 = p.mode == RopeIndexMode::kHf5;
  a.tps_integral = p.tokens_per_second == float(int64_t(p.tokens_per_second));
  if (a.B == 0) return;
  MMFUSE_CHECK(a.B < (int64_t(1) << 31), "rope_index: batch of ", a.B, " rows: expected fewer than 2^31");
  rope_index_kernel<true><<<unsigned(a.B), kThreads, 0, stream>>>(a);
  MMFUSE_CUDA_CHECK_LAUNCH("rope_index (span counts)");
  rope_index_kernel<false><<<unsigned(a.B), kThreads, 0, stream>>>(a);
  MMFUSE_CUDA_CHECK_LAUNCH("rope_index");
}

// ---- vision ---------------------------------------------------------------------------------------
namespace {

constexpr int kPrefixThreads = 1024;
enum : int { kTok = 0, kWin = 1, kFrame = 2, kPatch = 3 };

struct VisionArgs {
  IndexRef grid;
  int64_t n;
  int m, ws;
  VisionGridSizes s;
  int64_t* pre;  // [n + 1][4]: exclusive prefix sums of merged tokens, windows, frames, patches
};

struct Counts4 {
  int64_t v[4];
};
struct Counts4Op {
  __device__ Counts4 operator()(const Counts4& a, const Counts4& b) const {
    return {{a.v[0] + b.v[0], a.v[1] + b.v[1], a.v[2] + b.v[2], a.v[3] + b.v[3]}};
  }
};

__global__ void __launch_bounds__(kPrefixThreads) vision_prefix_kernel(VisionArgs a) {
  __shared__ typename cub::BlockScan<Counts4, kPrefixThreads>::TempStorage temp;
  Counts4 carry{{0, 0, 0, 0}};
  for (int64_t base = 0; base < a.n; base += kPrefixThreads) {
    const int64_t g = base + threadIdx.x;
    Counts4 c{{0, 0, 0, 0}};
    if (g < a.n) {
      const int64_t t = a.grid(g, 0), h = a.grid(g, 1), w = a.grid(g, 2);
      if (!(t >= 1 && h >= 1 && w >= 1 && h % a.m == 0 && w % a.m == 0))
        MMFUSE_DEVICE_FAIL("vision: grid_thw[%lld] = (%lld, %lld, %lld): expected positive t, h, w with h and w "
                           "divisible by spatial_merge_size %d",
                           (long long)g, (long long)t, (long long)h, (long long)w, a.m);
      const int64_t hm = h / a.m, wm = w / a.m;
      c.v[kTok] = t * hm * wm;
      c.v[kWin] = a.ws ? t * ((hm + a.ws - 1) / a.ws) * ((wm + a.ws - 1) / a.ws) : 0;
      c.v[kFrame] = t;
      c.v[kPatch] = t * h * w;
    }
    Counts4 agg;
    cub::BlockScan<Counts4, kPrefixThreads>(temp).ExclusiveScan(c, c, Counts4{{0, 0, 0, 0}}, Counts4Op(), agg);
    __syncthreads();
    if (g < a.n)
      for (int k = 0; k < 4; ++k) a.pre[4 * g + k] = carry.v[k] + c.v[k];
    carry = Counts4Op()(carry, agg);
  }
  if (threadIdx.x == 0) {
    for (int k = 0; k < 4; ++k) a.pre[4 * a.n + k] = carry.v[k];
    if (carry.v[kTok] != a.s.tokens || carry.v[kPatch] != a.s.patches || carry.v[kFrame] != a.s.frames ||
        (a.ws && carry.v[kWin] != a.s.windows))
      MMFUSE_DEVICE_FAIL("vision: grid_thw on the device is not the grid the sizes were computed from (%lld "
                         "patches, expected %lld)",
                         (long long)carry.v[kPatch], (long long)a.s.patches);
  }
}

// The grid whose [pre[g][k], pre[g+1][k]) holds x (every grid has at least one of each).
__device__ int64_t find_grid(const int64_t* pre, int64_t n, int k, int64_t x) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (pre[4 * mid + k] <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

struct PositionsArgs {
  VisionArgs v;
  const float* inv_freq;
  int64_t fs, F;
  int64_t* pos;
  int64_t pos_s[2];
  float* ang;
  int64_t ang_s[2];
};

// One thread per (patch, group of 4 columns) of the angle table (or per patch without a table):
// 32-bit index math past the grid search (patches < 2^31), float4 stores when the rows allow them.
constexpr int kCols = 4;

__global__ void vision_positions_kernel(PositionsArgs a, int chunks, bool vec) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= a.v.s.patches * chunks) return;
  const int32_t n = int32_t(e / chunks), chunk = int32_t(e - int64_t(n) * chunks);
  const int64_t g = find_grid(a.v.pre, a.v.n, kPatch, n);
  const int32_t m = a.v.m, h = int32_t(a.v.grid(g, 1)), w = int32_t(a.v.grid(g, 2));
  const int32_t q = (n - int32_t(a.v.pre[4 * g + kPatch])) % (h * w);  // patch within its frame
  const int32_t block = q / (m * m), inner = q - block * (m * m), wm = w / m;
  const int32_t br = block / wm;
  const int32_t row = br * m + inner / m, col = (block - br * wm) * m + inner % m;
  if (a.pos && chunk == 0) {
    a.pos[int64_t(n) * a.pos_s[0]] = row;
    a.pos[int64_t(n) * a.pos_s[0] + a.pos_s[1]] = col;
  }
  if (!a.ang) return;
  const int32_t F = int32_t(a.F), j0 = chunk * kCols;
  float v[kCols];
  for (int c = 0; c < kCols; ++c) {
    const int32_t j = j0 + c, jj = j < F ? j : j - F;
    v[c] = j < 2 * F ? __fmul_rn(float(j < F ? row : col), a.inv_freq[jj * a.fs]) : 0.0f;
  }
  float* out = a.ang + int64_t(n) * a.ang_s[0];
  if (vec) {
    *reinterpret_cast<float4*>(out + j0) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    for (int c = 0; c < kCols && j0 + c < 2 * F; ++c) out[(j0 + c) * a.ang_s[1]] = v[c];
  }
}

struct WindowArgs {
  VisionArgs v;
  int64_t* idx;
  int64_t idx_s;
  int64_t* rev;
  int64_t rev_s;
  int32_t* cu;
  int64_t cu_s;
  int32_t* cus;
  int64_t cus_s;
};

// Threads [0, tokens): one merged token each (its place in window order); then [.., + windows): one
// window each (its cu_window_seqlens entry); then [.., + frames + 1): the leading zeros, cu_seqlens.
__global__ void window_index_kernel(WindowArgs a) {
  const VisionArgs& v = a.v;
  int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int m = v.m, ws = v.ws;
  if (e < v.s.tokens) {
    const int64_t g = find_grid(v.pre, v.n, kTok, e);
    const int64_t hm = v.grid(g, 1) / m, wm = v.grid(g, 2) / m, area = hm * wm;
    const int64_t local = e - v.pre[4 * g + kTok], f = local / area, r = (local % area) / wm, c = local % wm;
    const int64_t wr = r / ws, wc = c / ws;
    const int64_t vh = min(int64_t(ws), hm - wr * ws), vw = min(int64_t(ws), wm - wc * ws);
    const int64_t dest = v.pre[4 * g + kTok] + f * area + wr * ws * wm + wc * ws * vh + (r - wr * ws) * vw + (c - wc * ws);
    a.idx[dest * a.idx_s] = e;
    if (a.rev) a.rev[e * a.rev_s] = dest;
    return;
  }
  e -= v.s.tokens;
  if (e < v.s.windows) {
    const int64_t g = find_grid(v.pre, v.n, kWin, e);
    const int64_t hm = v.grid(g, 1) / m, wm = v.grid(g, 2) / m;
    const int64_t nwh = (hm + ws - 1) / ws, nww = (wm + ws - 1) / ws;
    const int64_t local = e - v.pre[4 * g + kWin], f = local / (nwh * nww);
    const int64_t wr = (local % (nwh * nww)) / nww, wc = local % nww;
    const int64_t vh = min(int64_t(ws), hm - wr * ws), vw = min(int64_t(ws), wm - wc * ws);
    const int64_t before = (f * hm * wm + wr * ws * wm + wc * ws * vh + vh * vw) * m * m;
    a.cu[(e + 1) * a.cu_s] = int32_t(v.pre[4 * g + kPatch] + before);
    return;
  }
  e -= v.s.windows;
  if (e == 0) {  // the leading zeros
    a.cu[0] = 0;
    if (a.cus) a.cus[0] = 0;
    return;
  }
  if (a.cus && e <= v.s.frames) {
    const int64_t g = find_grid(v.pre, v.n, kFrame, e - 1);
    const int64_t hw = v.grid(g, 1) * v.grid(g, 2);
    a.cus[e * a.cus_s] = int32_t(v.pre[4 * g + kPatch] + (e - v.pre[4 * g + kFrame]) * hw);
  }
}

VisionArgs vision_args(const TensorView& grid, int m, int ws, const VisionGridSizes& s, TensorView& work) {
  VisionArgs v;
  v.grid = ref(grid);
  v.n = grid.shape[0];
  v.m = m;
  v.ws = ws;
  v.s = s;
  v.pre = static_cast<int64_t*>(work.data);
  return v;
}

void launch_prefix(const VisionArgs& v, cudaStream_t stream) {
  vision_prefix_kernel<<<1, kPrefixThreads, 0, stream>>>(v);
  MMFUSE_CUDA_CHECK_LAUNCH("vision grid prefix");
}

unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  MMFUSE_CHECK(b < (int64_t(1) << 31), "vision: ", n, " outputs: too many for one launch");
  return unsigned(b);
}

}  // namespace

void vision_positions_cuda(const TensorView& grid, int m, const VisionGridSizes& s, const TensorView& inv_freq,
                           TensorView& positions, TensorView& angles, TensorView& work, cudaStream_t stream) {
  if (s.patches == 0) return;
  PositionsArgs a{};
  a.v = vision_args(grid, m, 0, s, work);
  a.inv_freq = inv_freq.defined() ? static_cast<const float*>(inv_freq.data) : nullptr;
  a.fs = inv_freq.defined() ? inv_freq.stride[0] : 0;
  a.F = inv_freq.defined() ? inv_freq.shape[0] : 0;
  a.pos = positions.defined() ? static_cast<int64_t*>(positions.data) : nullptr;
  a.ang = angles.defined() ? static_cast<float*>(angles.data) : nullptr;
  for (int i = 0; i < 2; ++i) {
    a.pos_s[i] = positions.defined() ? positions.stride[i] : 0;
    a.ang_s[i] = angles.defined() ? angles.stride[i] : 0;
  }
  if (a.ang && a.F == 0) a.ang = nullptr;
  if (!a.pos && !a.ang) return;
  launch_prefix(a.v, stream);
  const int chunks = a.ang ? int((2 * a.F + kCols - 1) / kCols) : 1;
  const bool vec = a.ang && (2 * a.F) % kCols == 0 && a.ang_s[1] == 1 && a.ang_s[0] % kCols == 0 &&
                   reinterpret_cast<uintptr_t>(a.ang) % 16 == 0;
  vision_positions_kernel<<<blocks_for(s.patches * chunks, 256), 256, 0, stream>>>(a, chunks, vec);
  MMFUSE_CUDA_CHECK_LAUNCH("vision_positions");
}

void window_index_cuda(const TensorView& grid, int m, int ws, const VisionGridSizes& s, TensorView& idx,
                       TensorView& rev, TensorView& cu, TensorView& cus, TensorView& work, cudaStream_t stream) {
  WindowArgs a{};
  a.v = vision_args(grid, m, ws, s, work);
  a.idx = static_cast<int64_t*>(idx.data);
  a.idx_s = idx.stride[0];
  a.rev = rev.defined() ? static_cast<int64_t*>(rev.data) : nullptr;
  a.rev_s = rev.defined() ? rev.stride[0] : 0;
  a.cu = static_cast<int32_t*>(cu.data);
  a.cu_s = cu.stride[0];
  a.cus = cus.defined() ? static_cast<int32_t*>(cus.data) : nullptr;
  a.cus_s = cus.defined() ? cus.stride[0] : 0;
  if (s.grids > 0) launch_prefix(a.v, stream);  // no grids: one thread writes the leading zeros
  window_index_kernel<<<blocks_for(s.tokens + s.windows + s.frames + 1, 256), 256, 0, stream>>>(a);
  MMFUSE_CUDA_CHECK_LAUNCH("window_index");
}

}  // namespace detail
}  // namespace mmfuse
