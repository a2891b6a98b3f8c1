// CUDA backend of fp8_quantize: row-major and transposed e4m3 / e5m2 copies of a tensor, with its
// amax and scale on the device.
//
// Quantize: a grid of blocks walks tiles of x (padded extents). The per-tensor cast: 128 x 128 tiles,
// a thread converts 16 contiguous values of a row at a time (fp32 multiply, round to nearest even,
// saturating), stores them to q (whole 128-byte lines) and, for qt, into an fp8 tile in shared memory
// that the block then reads as 4 x 4 byte blocks, transposes in registers and stores as whole lines of
// qt. The amax pass and the per-row kernels: 64 x 64 tiles, 16 values of a row a thread (16-byte
// runs of x, 4 runs apart: col16). amax: each block reduces its tiles, one atomicMax a block on the
// state's scratch word (a maximum is exact, so the result does not depend on the order), and the last
// block to finish (a counter in the state) moves the history and resets the scratch.
// Per row: an amax pass of row and column maxima (atomicMax into the caller's zeroed scratch), then a
// cast that scales q by rows and qt by columns (two conversions a value).
// Dynamic scaling runs an amax-only pass of the same shape first; delayed scaling launches that pass
// too, but its blocks return at once unless the history is fresh (all zero), and the cast reads the
// history at the start of every block and records this tensor's amax at the end of the same pass
// (every block has read the history before it counts itself done, so the last block may rewrite it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/swiglu_value.cuh"
#include "backends/fp8.h"
#include "mmfuse/fp8.h"
#include "mmfuse/swiglu.h"

namespace mmfuse {
namespace detail {
namespace {

constexpr int kTile = 64, kThreads = 256, kTileStride = kTile + 4;  // 68-byte rows: few bank conflicts
// Blocks a job gets per SM (about 6 are resident: 40 registers a thread): more than fit, so that the
// blocks that finish early pick up the rest (16 beat 2, 4 and 8).
constexpr int kBlocksPerSm = 16;

struct Job {
  const void* src;
  int64_t rows, cols, ld;
  uint8_t* q;  // [pad(rows), ldq = pad(cols)] or null
  int64_t ldq;
  uint8_t* qt;  // [pad(cols), ldqt = pad(rows)] or null
  int64_t ldqt;
  float* scale_inv;    // [1], or per row [prows]
  float* scale_inv_t;  // per row with qt: [pcols]
  float* state;        // per tensor
  float* scratch;      // per row: row maxima [prows], then column maxima [pcols] (as bits)
  float* partials;     // column sums: [64-row groups][ldp], or null
  int64_t ldp;         // pad(cols) rounded up to 64
  float* col_sums;     // [cols]
  int h;
  int64_t tiles_c, tiles;  // tile grid: tiles_c along the columns, tiles in all
  int64_t prows, pcols;  // pad(rows), pad(cols): the rows of q and of qt
  int first_block, blocks;
  bool e4m3, dynamic, vec, per_row;
  bool swiglu;  // src is [rows, 2 cols] gate | up: the values are swiglu(gate, up) (swiglu_value)
  // swiglu_grad: src is dy [rows, half], the values the [gate | up] gradient [rows, cols = 2 half] from
  // the pack (swiglu_grad_value of the unpacked gate and up)
  bool swiglu_grad;
  const uint8_t* pack_q;  // [rows, ld_pack] e4m3
  const float* pack_si;   // [rows, ld_pack_si]
  int64_t ld_pack, ld_pack_si, half;
  bool both;  // swiglu_grad, q only, vec: the cast walks the gate half and writes both halves' q
};

// The source kinds (a template parameter of the kernels that read x): x itself, the swiglu of a
// [gate | up] source, the [gate | up] gradient from a pack and dy.
constexpr int kPlainSrc = 0, kSwigluSrc = 1, kGradSrc = 2;

struct Jobs {
  Job j[2];
  int n;
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

// Column, within its tile, of value e of the thread at tile offset tc (16 x its place j in the row,
// 0..3). A thread's 16 values are the row's 16-byte runs j, j + 4, ... (V = 16 / sizeof(S) values a
// run), so that each load instruction of a warp reads whole 32-byte sectors: 4 threads read 64
// contiguous bytes of a row (16 contiguous values a thread would leave every sector half read by each
// of two instructions).
template <class S>
__device__ __forceinline__ int col16(int tc, int e) {
  constexpr int V = 16 / int(sizeof(S));
  return (tc / 16 + 4 * (e / V)) * V + e % V;
}

// The value of x at a loaded gate (and up) element: x itself, or the swiglu source's value.
template <class S, bool kSwiglu>
__device__ __forceinline__ float src_value(S g, S u) {
  if constexpr (kSwiglu) return to_f(cuda::swiglu_value(g, u));
  else return to_f(g);
}

// Column c of row i of the [gate | up] gradient (a swiglu_grad source; c < cols, i < rows).
template <class S>
__device__ __forceinline__ float grad_at(const Job& jb, int64_t i, int64_t c) {
  const bool up = c >= jb.half;
  const int64_t k = up ? c - jb.half : c;
  const uint8_t* qr = jb.pack_q + i * jb.ld_pack;
  const float* sr = jb.pack_si + i * jb.ld_pack_si;
  S dg, du, y;
  cuda::swiglu_grad_value<S, false>(cuda::swiglu_unpack(qr[k], sr[k / kSwigluPackTile]),
                                    cuda::swiglu_unpack(qr[jb.half + k], sr[(jb.half + k) / kSwigluPackTile]),
                                    to_f(static_cast<const S*>(jb.src)[i * jb.ld + k]), dg, du, y);
  return to_f(up ? du : dg);
}

// The thread's 16 values of row i of the tile at column c0 (zero outside the tensor).
template <class S, int kSrc>
__device__ __forceinline__ void load16(const Job& jb, int64_t i, int64_t c0, int tc, float (&v)[16]) {
  constexpr bool kSwiglu = kSrc == kSwigluSrc;
#pragma unroll
  for (int e = 0; e < 16; ++e) v[e] = 0.0f;
  if (i >= jb.rows) return;
  if constexpr (kSrc == kGradSrc) {  // one value at a time (the amax pass: a fresh or dynamic state only)
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int64_t c = c0 + col16<S>(tc, e);
      if (c < jb.cols) v[e] = grad_at<S>(jb, i, c);
    }
    return;
  }
  const S* row = static_cast<const S*>(jb.src) + i * jb.ld + c0;
  const int64_t left = jb.cols - c0;      // columns of x from the tile's first on
  constexpr int V = 16 / int(sizeof(S));  // values of one 16-byte run
  if (jb.vec) {  // cols, ld and the base are multiples of V values: each run is in or out
#pragma unroll
    for (int e = 0; e < 16; e += V) {
      const int c = col16<S>(tc, e);
      if (c < left) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + c));
        uint4 raw_up = raw;
        if constexpr (kSwiglu) raw_up = __ldg(reinterpret_cast<const uint4*>(row + jb.cols + c));
        const S* s = reinterpret_cast<const S*>(&raw);
        const S* su = reinterpret_cast<const S*>(&raw_up);
#pragma unroll
        for (int u = 0; u < V; ++u) v[e + u] = src_value<S, kSwiglu>(s[u], su[u]);
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int c = col16<S>(tc, e);
      if (c < left) v[e] = src_value<S, kSwiglu>(row[c], kSwiglu ? row[jb.cols + c] : row[c]);
    }
  }
}

// The thread's 4 words (values 4p .. 4p + 3 in word p, contiguous columns) into a row of fp8 bytes
// that starts at the tile's column 0 and has `left` columns from there: one store a run.
template <class S>
__device__ __forceinline__ void store_words(uint8_t* row, int64_t left, int tc, const uint32_t (&w)[4]) {
  constexpr int V = 16 / int(sizeof(S));
#pragma unroll
  for (int p = 0; p < 4; p += V / 4) {
    const int c = col16<S>(tc, 4 * p);
    if (c >= left) continue;
    if constexpr (V == 8) *reinterpret_cast<uint2*>(row + c) = make_uint2(w[p], w[p + 1]);
    else *reinterpret_cast<uint32_t*>(row + c) = w[p];
  }
}

// The thread's 16 values of tile t.
template <class S, int kSrc>
__device__ __forceinline__ void load_tile(const Job& jb, int64_t t, int tr, int tc, float (&v)[16]) {
  load16<S, kSrc>(jb, (t / jb.tiles_c) * kTile + tr, (t % jb.tiles_c) * kTile, tc, v);
}

// Calls body(t, v) for the block's tiles t of jb in order, v = the thread's 16 values of tile t (zero
// outside x). Called by the whole block (body may synchronise it: every thread walks the same tiles).
template <class S, int kSrc = kPlainSrc, class Body>
__device__ __forceinline__ void for_each_tile(const Job& jb, int tr, int tc, Body&& body) {
  float v[16];
  for (int64_t t = int(blockIdx.x) - jb.first_block; t < jb.tiles; t += jb.blocks) {
    load_tile<S, kSrc>(jb, t, tr, tc, v);
    body(t, v);
  }
}

using cuda::fp8_finite_abs;
using cuda::fp8_scaled;

// 16 values times their scales (sc(e)), rounded to fp8 (nearest even, saturating; Inf and NaN to
// NaN), as 4 words.
template <class Scale>
__device__ __forceinline__ void pack_fp8(const float (&v)[16], Scale sc, __nv_fp8_interpretation_t fmt,
                                         uint32_t (&w)[4]) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(fp8_scaled(v[4 * p], sc(4 * p)), fp8_scaled(v[4 * p + 1], sc(4 * p + 1))), __NV_SATFINITE, fmt);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(fp8_scaled(v[4 * p + 2], sc(4 * p + 2)), fp8_scaled(v[4 * p + 3], sc(4 * p + 3))), __NV_SATFINITE,
        fmt);
    w[p] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
}

// qt's part of a tile: the block's words through shared memory, so that a thread stores 16 rows of
// one column of x (a row of qt) as 16 bytes. Called by the whole block.
template <class S>
__device__ __forceinline__ void store_transposed(const Job& jb, uint8_t* tile, const uint32_t (&w)[4], int64_t r0,
                                                 int64_t c0, int tr, int tc) {
  __syncthreads();  // the previous tile's reads are done
#pragma unroll
  for (int p = 0; p < 4; ++p) *reinterpret_cast<uint32_t*>(tile + tr * kTileStride + col16<S>(tc, 4 * p)) = w[p];
  __syncthreads();
  // thread (another mapping here): qt row c0 + tr (a column of x), x rows r0 + tc .. r0 + tc + 15
  const int64_t qrow = c0 + tr, qcol = r0 + tc;
  if (qrow < jb.pcols && qcol < jb.ldqt) {
    uint32_t o[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint8_t* col = tile + (tc + 4 * p) * kTileStride + tr;
      o[p] = uint32_t(col[0]) | uint32_t(col[kTileStride]) << 8 | uint32_t(col[2 * kTileStride]) << 16 |
             uint32_t(col[3 * kTileStride]) << 24;
    }
    *reinterpret_cast<uint4*>(jb.qt + qrow * jb.ldqt + qcol) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kThreads / 32; ++w) v = fmaxf(v, red[w]);
  return v;  // valid in thread 0
}

// Thread 0 of every block: fold the block's amax into the state; the last block records it in the
// history (newest first) and leaves the scratch words at zero.
__device__ void finish_amax(const Job& jb, float amax) {
  unsigned* acc = reinterpret_cast<unsigned*>(jb.state + jb.h);
  unsigned* count = acc + 1;
  if (amax > 0.0f) atomicMax(acc, __float_as_uint(amax));  // non-negative floats order as their bits
  __threadfence();
  if (atomicAdd(count, 1u) != unsigned(jb.blocks - 1)) return;
  __threadfence();
  const float total = __uint_as_float(atomicExch(acc, 0u));
  atomicExch(count, 0u);
  for (int i = jb.h - 1; i > 0; --i) jb.state[i] = jb.state[i - 1];
  jb.state[0] = total;
}

__device__ __forceinline__ const Job& my_job(const Jobs& jobs) {
  return jobs.n > 1 && int(blockIdx.x) >= jobs.j[1].first_block ? jobs.j[1] : jobs.j[0];
}

template <class S, int kSrc>
__global__ void __launch_bounds__(kThreads) fp8_amax_kernel(const __grid_constant__ Jobs jobs) {
  __shared__ float red[kThreads / 32];
  const Job& jb = my_job(jobs);
  if (!jb.dynamic) {  // delayed scaling needs this pass only for a fresh (all-zero) history
    float past = 0.0f;
    for (int i = 0; i < jb.h; ++i) past = fmaxf(past, jb.state[i]);
    if (past > 0.0f) return;  // the same answer in every block: none of them counts itself done
  }
  const int tr = threadIdx.x / 4, tc = (threadIdx.x % 4) * 16;
  float amax = 0.0f;
  for_each_tile<S, kSrc>(jb, tr, tc, [&](int64_t, const float(&v)[16]) {
#pragma unroll
    for (int e = 0; e < 16; ++e) amax = fmaxf(amax, fp8_finite_abs(v[e]));
  });
  amax = block_max(amax, red);
  if (threadIdx.x == 0) finish_amax(jb, amax);
}

// The tile's 64 column sums of the thread's raw values (over the warp's 8 rows by a fixed shuffle
// tree, then over the 8 warps in order) into partials[tile row][column]. Called by the whole block.
template <class S>
__device__ __forceinline__ void col_partials(const Job& jb, float (&v)[16], int64_t tile_row, int64_t c0, int tc,
                                             float (*sums)[kTile]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float s[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    s[e] = v[e];
    s[e] += __shfl_xor_sync(0xffffffffu, s[e], 4);
    s[e] += __shfl_xor_sync(0xffffffffu, s[e], 8);
    s[e] += __shfl_xor_sync(0xffffffffu, s[e], 16);
  }
  __syncthreads();  // the previous tile's sums are read
  if (lane < 4) {
#pragma unroll
    for (int e = 0; e < 16; ++e) sums[warp][col16<S>(tc, e)] = s[e];
  }
  __syncthreads();
  if (threadIdx.x < kTile) {
    float acc = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) acc += sums[w][threadIdx.x];
    jb.partials[tile_row * jb.ldp + c0 + threadIdx.x] = acc;
  }
}

// col_sums[c] = the partial sums of column c over the tile rows in a fixed order: a block is 32
// columns x 8 row groups, group y sums the tile rows y, y + 8, ... in order, then the 8 groups in order.
constexpr int kSumCols = 32, kSumGroups = kThreads / kSumCols;
__global__ void __launch_bounds__(kThreads) fp8_col_sums_kernel(const float* partials, int64_t tile_rows, int64_t ld,
                                                                int64_t cols, float* col_sums) {
  __shared__ float part[kSumGroups][kSumCols];
  const int x = threadIdx.x % kSumCols, y = threadIdx.x / kSumCols;
  const int64_t c = int64_t(blockIdx.x) * kSumCols + x;
  float acc = 0.0f;
  if (c < cols)
    for (int64_t t = y; t < tile_rows; t += kSumGroups) acc += partials[t * ld + c];
  part[y][x] = acc;
  __syncthreads();
  if (y == 0 && c < cols) {
    for (int g = 1; g < kSumGroups; ++g) acc += part[g][x];
    col_sums[c] = acc;
  }
}

// ---- the per-tensor cast: 128 x 128 tiles -------------------------------------------------------

// A tile's pass p (0..3) is its rows 32 p .. 32 p + 31: thread (row lr = tid / 8 of the pass, group
// g = tid % 8) has 16 values, columns 16 g .. 16 g + 15 (8 threads read a row's 256 or 512 bytes
// whole). Loads run kAhead passes ahead of their use (raw, kCastAheadBytes). q's part: 16 bytes a
// thread, 128-byte lines. qt's part: the tile's fp8 bytes through shared memory (128 rows x 32
// words; the 16-byte group g of row r at g ^ ((r / 16) % 8), so that both phases are conflict-free),
// then a thread transposes 4 x 4 byte blocks in registers and stores 16 rows of x of 4 of its
// columns: 4 rows of qt, 16 bytes each, again whole lines (faster than the 64 x 64 tiles of the
// other kernels).
constexpr int kCastTile = 128, kCastWords = kCastTile / 4;
// Raw bytes of x a thread holds for the look-ahead (at least one pass): bf16 / fp16 4 passes (64
// registers), 2 with the column sums (whose extra registers then cost occupancy); fp32 half that.
template <bool kColSums>
constexpr int kCastAheadBytes = kColSums ? 64 : 128;
// Passes loaded ahead: as many as the raw bytes allow (a swiglu source loads gate and up), 1 to 4.
template <class S, bool kColSums, bool kSwiglu>
constexpr int cast_ahead() {
  constexpr int fit = kCastAheadBytes<kColSums> / (16 * int(sizeof(S)) * (kSwiglu ? 2 : 1));
  return fit < 1 ? 1 : fit > 4 ? 4 : fit;
}

template <class S>
struct alignas(16) Raw16 {  // one thread's 16 values of a pass, as loaded
  S s[16];
};

// off: the column of src where x's column 0 is (the up half of a swiglu source: cols).
template <class S>
__device__ __forceinline__ void load_pass(const Job& jb, int64_t i, int64_t cc, Raw16<S>& raw, int64_t off = 0) {
  constexpr int V = 16 / int(sizeof(S));
  if (jb.vec) {  // cols, ld and the base are multiples of V values: a 16-byte run is in or out
#pragma unroll
    for (int e = 0; e < 16; e += V) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (i < jb.rows && cc + e < jb.cols) u = __ldg(reinterpret_cast<const uint4*>(static_cast<const S*>(jb.src) +
                                                                                      i * jb.ld + off + cc + e));
      *reinterpret_cast<uint4*>(&raw.s[e]) = u;
    }
  } else {
    const S* row = static_cast<const S*>(jb.src) + i * jb.ld + off;
#pragma unroll
    for (int e = 0; e < 16; e += V) *reinterpret_cast<uint4*>(&raw.s[e]) = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int e = 0; e < 16; ++e)
      if (i < jb.rows && cc + e < jb.cols) raw.s[e] = row[cc + e];
  }
}

// The tile's 64-row halves' column sums of the raw values (the thread's two passes of the half, then
// the warp's 4 load rows by a fixed shuffle tree, then the 8 warps in order) into partials[64-row
// group][column], the layout of the per-row kernel's col_partials. Called by the whole block, once a
// half, after the half's second pass (s: the thread's sums of its two rows).
__device__ __forceinline__ void half_partials(const Job& jb, float (&s)[16], int64_t r0, int64_t c0, int half,
                                              float (*sums)[kCastTile]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = threadIdx.x % 8;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    s[e] += __shfl_xor_sync(0xffffffffu, s[e], 8);
    s[e] += __shfl_xor_sync(0xffffffffu, s[e], 16);
  }
  __syncthreads();  // the previous half's sums are read
  if (lane < 8) {
#pragma unroll
    for (int e = 0; e < 16; ++e) sums[warp][16 * g + e] = s[e];
  }
  __syncthreads();
  const int64_t gr = r0 / kTile + half, c = c0 + threadIdx.x;  // the 64-row group, the column
  if (threadIdx.x < kCastTile && gr * kTile < jb.prows && c < jb.ldp) {
    float acc = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) acc += sums[w][threadIdx.x];
    jb.partials[gr * jb.ldp + c] = acc;
  }
}

// vec: the gate (vg) and up (vu) gradients of row i, columns k .. k + 15 of the gate half (k < half, a
// multiple of 16; i < rows), from whole 16-byte runs of dy, gate and up.
template <class S>
__device__ __forceinline__ void grad16_vec(const Job& jb, int64_t i, int64_t k, float (&vg)[16], float (&vu)[16]) {
  constexpr int V = 16 / int(sizeof(S));
  Raw16<S> d;
#pragma unroll
  for (int e = 0; e < 16; e += V)
    *reinterpret_cast<uint4*>(&d.s[e]) = __ldg(reinterpret_cast<const uint4*>(static_cast<const S*>(jb.src) +
                                                                               i * jb.ld + k + e));
  const uint8_t* qr = jb.pack_q + i * jb.ld_pack;
  const uint4 graw = __ldg(reinterpret_cast<const uint4*>(qr + k));
  const uint4 uraw = __ldg(reinterpret_cast<const uint4*>(qr + jb.half + k));
  const uint8_t* gq = reinterpret_cast<const uint8_t*>(&graw);
  const uint8_t* uq = reinterpret_cast<const uint8_t*>(&uraw);
  const float* sr = jb.pack_si + i * jb.ld_pack_si;
  const float gs = sr[k / kSwigluPackTile], us = sr[(jb.half + k) / kSwigluPackTile];
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    S dg, du, y;
    cuda::swiglu_grad_value<S, false>(cuda::swiglu_unpack(gq[e], gs), cuda::swiglu_unpack(uq[e], us), to_f(d.s[e]), dg,
                                      du, y);
    vg[e] = to_f(dg);
    vu[e] = to_f(du);
  }
}

// The 16 values of row i, columns cc .. cc + 15 (cc a multiple of 16), of the [gate | up] gradient
// (zero outside it). vec (half a multiple of 16, aligned rows): the 16 columns lie in one half and one
// pack tile, so dy, gate and up load as whole 16-byte runs.
template <class S>
__device__ __forceinline__ void grad16(const Job& jb, int64_t i, int64_t cc, float (&v)[16]) {
#pragma unroll
  for (int e = 0; e < 16; ++e) v[e] = 0.0f;
  if (i >= jb.rows || cc >= jb.cols) return;
  if (!jb.vec) {
#pragma unroll
    for (int e = 0; e < 16; ++e)
      if (cc + e < jb.cols) v[e] = grad_at<S>(jb, i, cc + e);
    return;
  }
  const bool up = cc >= jb.half;
  float vg[16], vu[16];
  grad16_vec<S>(jb, i, up ? cc - jb.half : cc, vg, vu);
#pragma unroll
  for (int e = 0; e < 16; ++e) v[e] = up ? vu[e] : vg[e];
}

template <class S, bool kColSums, int kSrc>
__global__ void __launch_bounds__(kThreads) fp8_cast_kernel(const __grid_constant__ Jobs jobs) {
  constexpr bool kSwiglu = kSrc == kSwigluSrc, kGrad = kSrc == kGradSrc;
  // a swiglu_grad source loads as it computes (grad16), one pass at a time
  constexpr int kAhead = kGrad ? 1 : cast_ahead<S, kColSums, kSwiglu>();
  __shared__ __align__(16) uint32_t tile[kCastTile * kCastWords];
  __shared__ float red[kThreads / 32];
  __shared__ float sums[kColSums ? kThreads / 32 : 1][kCastTile];
  const Job& jb = my_job(jobs);
  float use = jb.state[0];
  if (!jb.dynamic)
    for (int i = 1; i < jb.h; ++i) use = fmaxf(use, jb.state[i]);
  const float scale = __fdiv_rn(jb.e4m3 ? 448.0f : 57344.0f, fmaxf(use, kFp8AmaxEps));
  const int b = int(blockIdx.x) - jb.first_block;
  if (b == 0 && threadIdx.x == 0) *jb.scale_inv = __fdiv_rn(1.0f, scale);
  const __nv_fp8_interpretation_t fmt = jb.e4m3 ? __NV_E4M3 : __NV_E5M2;
  const int lr = threadIdx.x / 8, g = threadIdx.x % 8;
  float amax = 0.0f;
  for (int64_t t = b; t < jb.tiles; t += jb.blocks) {
    const int64_t r0 = (t / jb.tiles_c) * kCastTile, c0 = (t % jb.tiles_c) * kCastTile, cc = c0 + 16 * g;
    float s[16];
#pragma unroll
    for (int p0 = 0; p0 < 4; p0 += kAhead) {
      Raw16<S> raw[kGrad ? 1 : kAhead], raw_up[kSwiglu ? kAhead : 1];
#pragma unroll
      for (int a = 0; a < kAhead; ++a) {
        if constexpr (kGrad) continue;
        load_pass<S>(jb, r0 + 32 * (p0 + a) + lr, cc, raw[a]);
        if constexpr (kSwiglu) load_pass<S>(jb, r0 + 32 * (p0 + a) + lr, cc, raw_up[a], jb.cols);
      }
#pragma unroll
      for (int a = 0; a < kAhead; ++a) {
        const int p = p0 + a, r = 32 * p + lr;
        float v[16];
        if constexpr (kGrad) {
          if (jb.both) {  // columns cc .. cc + 15 of the gate half: their gate and up gradients' rows of q
            float vu[16];
            if (r0 + r < jb.rows && cc < jb.half) {
              grad16_vec<S>(jb, r0 + r, cc, v, vu);
            } else {  // a padding row: zeros
#pragma unroll
              for (int e = 0; e < 16; ++e) v[e] = vu[e] = 0.0f;
            }
            uint32_t w[4], wu[4];
            pack_fp8(v, [&](int) { return scale; }, fmt, w);
            pack_fp8(vu, [&](int) { return scale; }, fmt, wu);
            if (!jb.dynamic) {
#pragma unroll
              for (int e = 0; e < 16; ++e) amax = fmaxf(amax, fmaxf(fp8_finite_abs(v[e]), fp8_finite_abs(vu[e])));
            }
            if (r0 + r < jb.prows && cc < jb.half) {
              uint8_t* qr = jb.q + (r0 + r) * jb.ldq;
              *reinterpret_cast<uint4*>(qr + cc) = make_uint4(w[0], w[1], w[2], w[3]);
              *reinterpret_cast<uint4*>(qr + jb.half + cc) = make_uint4(wu[0], wu[1], wu[2], wu[3]);
            }
            continue;
          }
          grad16<S>(jb, r0 + r, cc, v);
        } else {
#pragma unroll
          for (int e = 0; e < 16; ++e) {
            if constexpr (kSwiglu) v[e] = src_value<S, true>(raw[a].s[e], raw_up[a].s[e]);
            else v[e] = to_f(raw[a].s[e]);
          }
        }
        uint32_t w[4];
        pack_fp8(v, [&](int) { return scale; }, fmt, w);
        if (!jb.dynamic) {
#pragma unroll
          for (int e = 0; e < 16; ++e) amax = fmaxf(amax, fp8_finite_abs(v[e]));
        }
        if constexpr (kColSums) {
#pragma unroll
          for (int e = 0; e < 16; ++e) s[e] = p % 2 == 0 ? v[e] : s[e] + v[e];
          if (p % 2 == 1) half_partials(jb, s, r0, c0, p / 2, sums);
        }
        const uint4 word4 = make_uint4(w[0], w[1], w[2], w[3]);
        if (jb.q && r0 + r < jb.prows && cc < jb.ldq) *reinterpret_cast<uint4*>(jb.q + (r0 + r) * jb.ldq + cc) = word4;
        if (jb.qt) {
          if (p == 0) __syncthreads();  // the previous tile's transposed reads are done (same for the block)
          *reinterpret_cast<uint4*>(&tile[r * kCastWords + 4 * (g ^ (r / 16) % 8)]) = word4;
        }
      }
    }
    if (!jb.qt) continue;  // the same for the whole block
    __syncthreads();
    // thread: x rows 16 m .. 16 m + 15 (m = tid % 8), columns 4 k .. 4 k + 3 (k = tid / 8)
    const int m = threadIdx.x % 8, k = threadIdx.x / 8;
    uint32_t o[4][4];  // o[j][q]: x rows 16 m + 4 q .. + 3 of column 4 k + j (4 bytes of a qt row)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * m + 4 * q + r;
        a[r] = tile[row * kCastWords + (k ^ 4 * ((row / 16) % 8))];
      }
      const uint32_t t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362);
      const uint32_t t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362);
      o[0][q] = __byte_perm(t0, t2, 0x5410);
      o[1][q] = __byte_perm(t0, t2, 0x7632);
      o[2][q] = __byte_perm(t1, t3, 0x5410);
      o[3][q] = __byte_perm(t1, t3, 0x7632);
    }
    const int64_t qcol = r0 + 16 * m;
    if (qcol < jb.ldqt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t qrow = c0 + 4 * k + j;
        if (qrow < jb.pcols)
          *reinterpret_cast<uint4*>(jb.qt + qrow * jb.ldqt + qcol) = make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
      }
    }
  }
  if (!jb.dynamic) {
    amax = block_max(amax, red);
    if (threadIdx.x == 0) finish_amax(jb, amax);
  }
}

// ---- per row ---------------------------------------------------------------------------------

// Row and column maxima of x into the scratch (atomicMax on the bits: exact, order-free): a row's
// four threads combine theirs by shuffles, a column's 64 rows by shuffles within the warp and the
// block's warps through shared memory.
template <class S>
__global__ void __launch_bounds__(kThreads) fp8_amax_rows_kernel(const __grid_constant__ Jobs jobs) {
  __shared__ float cols[kThreads / 32][kTile];
  const Job& jb = my_job(jobs);
  unsigned* row_amax = reinterpret_cast<unsigned*>(jb.scratch);
  unsigned* col_amax = row_amax + jb.prows;
  const int tr = threadIdx.x / 4, tc = (threadIdx.x % 4) * 16, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for_each_tile<S>(jb, tr, tc, [&](int64_t t, float(&v)[16]) {
    const int64_t r0 = (t / jb.tiles_c) * kTile, c0 = (t % jb.tiles_c) * kTile;
    float rm = 0.0f;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      v[e] = fp8_finite_abs(v[e]);
      rm = fmaxf(rm, v[e]);
    }
    rm = fmaxf(rm, __shfl_xor_sync(0xffffffffu, rm, 1));
    rm = fmaxf(rm, __shfl_xor_sync(0xffffffffu, rm, 2));
    if (tc == 0 && r0 + tr < jb.rows && rm > 0.0f) atomicMax(row_amax + r0 + tr, __float_as_uint(rm));
#pragma unroll
    for (int e = 0; e < 16; ++e) {  // over the warp's 8 rows (lanes 4 apart share columns)
      v[e] = fmaxf(v[e], __shfl_xor_sync(0xffffffffu, v[e], 4));
      v[e] = fmaxf(v[e], __shfl_xor_sync(0xffffffffu, v[e], 8));
      v[e] = fmaxf(v[e], __shfl_xor_sync(0xffffffffu, v[e], 16));
    }
    __syncthreads();  // the previous tile's column maxima are read
    if (lane < 4) {
#pragma unroll
      for (int e = 0; e < 16; ++e) cols[warp][col16<S>(tc, e)] = v[e];
    }
    __syncthreads();
    if (threadIdx.x < kTile) {
      float cm = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) cm = fmaxf(cm, cols[w][threadIdx.x]);
      if (c0 + threadIdx.x < jb.cols && cm > 0.0f) atomicMax(col_amax + c0 + threadIdx.x, __float_as_uint(cm));
    }
  });
}

// The cast with a scale a row of q (its row's amax) and a row of qt (its column's amax); the tiles
// at column 0 / row 0 write the inverse scales.
template <class S, bool kColSums>
__global__ void __launch_bounds__(kThreads) fp8_cast_rows_kernel(const __grid_constant__ Jobs jobs) {
  __shared__ __align__(16) uint8_t tile[kTile * kTileStride];
  __shared__ float sums[kColSums ? kThreads / 32 : 1][kTile];
  const Job& jb = my_job(jobs);
  const unsigned* row_amax = reinterpret_cast<const unsigned*>(jb.scratch);
  const unsigned* col_amax = row_amax + jb.prows;
  const float fmax = jb.e4m3 ? 448.0f : 57344.0f;
  auto scale_of = [&](unsigned bits) { return __fdiv_rn(fmax, fmaxf(__uint_as_float(bits), kFp8AmaxEps)); };
  const __nv_fp8_interpretation_t fmt = jb.e4m3 ? __NV_E4M3 : __NV_E5M2;
  if (jb.tiles == 0) {  // x is empty: the padding rows (or columns) of its copies have amax 0
    const float si = __fdiv_rn(1.0f, scale_of(0u));
    for (int64_t i = threadIdx.x; i < jb.prows; i += kThreads) jb.scale_inv[i] = si;
    for (int64_t i = threadIdx.x; jb.scale_inv_t && i < jb.pcols; i += kThreads) jb.scale_inv_t[i] = si;
    return;
  }
  const int tr = threadIdx.x / 4, tc = (threadIdx.x % 4) * 16;
  for_each_tile<S>(jb, tr, tc, [&](int64_t t, float(&v)[16]) {
    const int64_t r0 = (t / jb.tiles_c) * kTile, c0 = (t % jb.tiles_c) * kTile;
    if constexpr (kColSums) col_partials<S>(jb, v, t / jb.tiles_c, c0, tc, sums);
    const int64_t i = r0 + tr;
    if (jb.q) {
      const float sr = i < jb.prows ? scale_of(row_amax[i]) : 1.0f;
      uint32_t w[4];
      pack_fp8(v, [&](int) { return sr; }, fmt, w);
      if (i < jb.prows) {
        store_words<S>(jb.q + i * jb.ldq + c0, jb.ldq - c0, tc, w);
        if (c0 == 0 && tc == 0) jb.scale_inv[i] = __fdiv_rn(1.0f, sr);
      }
    }
    if (jb.qt) {
      float sc[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int64_t k = c0 + col16<S>(tc, e);
        sc[e] = k < jb.pcols ? scale_of(col_amax[k]) : 1.0f;
      }
      uint32_t w[4];
      pack_fp8(v, [&](int e) { return sc[e]; }, fmt, w);
      if (r0 == 0 && tr == 0)
        for (int e = 0; e < 16; ++e) {
          const int64_t k = c0 + col16<S>(tc, e);
          if (k < jb.pcols) jb.scale_inv_t[k] = __fdiv_rn(1.0f, sc[e]);
        }
      store_transposed<S>(jb, tile, w, r0, c0, tr, tc);
    }
  });
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

Job make_job(const Fp8QuantJob& in, bool for_cast) {
  Job j{};
  j.src = in.src.data;
  j.rows = in.src.shape[0];
  j.swiglu = in.swiglu;
  j.swiglu_grad = in.swiglu_grad;
  j.cols = in.swiglu ? in.src.shape[1] / 2 : in.swiglu_grad ? 2 * in.src.shape[1] : in.src.shape[1];
  j.ld = j.rows > 1 ? in.src.stride[0] : in.swiglu_grad ? in.src.shape[1] : j.cols;
  if (in.swiglu_grad) {
    j.half = in.src.shape[1];
    j.pack_q = in.pack_q.ptr<uint8_t>();
    j.pack_si = in.pack_scale_inv.ptr<float>();
    j.ld_pack = j.rows > 1 ? in.pack_q.stride[0] : in.pack_q.shape[1];
    j.ld_pack_si = j.rows > 1 ? in.pack_scale_inv.stride[0] : in.pack_scale_inv.shape[1];
  }
  j.q = in.q.defined() ? in.q.ptr<uint8_t>() : nullptr;
  j.ldq = in.q.defined() ? in.q.shape[1] : 0;
  j.qt = in.qt.defined() ? in.qt.ptr<uint8_t>() : nullptr;
  j.ldqt = in.qt.defined() ? in.qt.shape[1] : 0;
  j.prows = fp8_padded(j.rows);
  j.pcols = fp8_padded(j.cols);
  j.scale_inv = in.scale_inv.ptr<float>();
  j.per_row = in.per_row;
  j.scale_inv_t = in.per_row && in.qt.defined() ? in.scale_inv_t.ptr<float>() : nullptr;
  j.scratch = in.per_row ? in.scratch.ptr<float>() : nullptr;
  j.col_sums = in.col_sums.defined() ? in.col_sums.ptr<float>() : nullptr;
  j.partials = in.col_sums.defined() ? in.partials.ptr<float>() : nullptr;
  j.state = in.per_row ? nullptr : in.state.ptr<float>();
  j.h = in.per_row ? 0 : int(in.state.shape[0] - 2);
  j.e4m3 = (in.q.defined() ? in.q.dtype : in.qt.dtype) == DType::kFloat8E4M3;
  j.dynamic = in.dynamic;
  const int64_t v = 16 / int64_t(dtype_size(in.src.dtype));
  j.vec = j.cols % v == 0 && j.ld % v == 0 && cuda::alignment(j.src) >= 16;
  if (in.swiglu_grad) {  // grad16's whole runs: 16 columns in one half, dy's and the pack's rows aligned
    j.vec = j.half % 16 == 0 && j.ld % v == 0 && cuda::alignment(j.src) >= 16 && j.ld_pack % 16 == 0 &&
            cuda::alignment(j.pack_q) >= 16;
    // q alone: each value of dy and the pack read once, both halves written from it (cols = 2 half:
    // no padding columns)
    j.both = j.vec && !j.qt;
  }
  j.ldp = cdiv(j.pcols, kTile) * kTile;
  // extents walked: the cast covers the padding it writes (zeros), the amax pass only x; the
  // per-tensor cast in 128 x 128 tiles, the other kernels in 64 x 64
  const int64_t rows = for_cast ? fp8_padded(j.rows) : j.rows;
  const int64_t cols = for_cast ? (j.both ? j.half : fp8_padded(j.cols)) : j.cols;
  const int64_t tile = for_cast && !in.per_row ? kCastTile : kTile;
  j.tiles_c = std::max<int64_t>(1, cdiv(cols, tile));
  j.tiles = rows > 0 && cols > 0 ? cdiv(rows, tile) * j.tiles_c : 0;
  return j;
}

// Splits the resident blocks between the jobs by their tiles (each at least one block: the one that
// records the amax of an empty tensor). In the amax pass a delayed job's blocks return at once
// unless its history is fresh (the first call): it gets one block an SM, the dynamic jobs the rest.
unsigned assign_blocks(Jobs& jobs, bool amax_pass) {
  const int64_t sms = cuda::sm_count(), cap = sms * kBlocksPerSm;
  auto light = [&](const Job& j) { return amax_pass && !j.dynamic; };
  int64_t total = 0;
  for (int i = 0; i < jobs.n; ++i) total += light(jobs.j[i]) ? 0 : jobs.j[i].tiles;
  int first = 0;
  for (int i = 0; i < jobs.n; ++i) {
    Job& j = jobs.j[i];
    const int64_t share = light(j) ? sms : total > 0 ? cdiv(cap * j.tiles, total) : 1;
    j.blocks = int(std::max<int64_t>(1, std::min(j.tiles, share)));
    j.first_block = first;
    first += j.blocks;
  }
  return unsigned(first);
}

template <class F>
void dispatch_src(DType t, F&& f) {
  switch (t) {
    case DType::kBFloat16: return f(__nv_bfloat16{});
    case DType::kFloat16: return f(__half{});
    default: return f(float{});
  }
}

template <auto Kernel>
void run(const char* name, unsigned blocks, const Jobs& jobs, cudaStream_t stream) {
  Kernel<<<blocks, kThreads, 0, stream>>>(jobs);
  MMFUSE_CUDA_CHECK_LAUNCH(name);
}

void launch(const Fp8QuantJob* in, const int* idx, int n, bool amax_pass, cudaStream_t stream) {
  Jobs jobs{};
  jobs.n = n;
  for (int i = 0; i < n; ++i) jobs.j[i] = make_job(in[idx[i]], !amax_pass);
  const unsigned blocks = assign_blocks(jobs, amax_pass);
  dispatch_src(in[idx[0]].src.dtype, [&](auto tag) {
    using S = decltype(tag);
    // the same for the jobs of one launch: per row, swiglu, swiglu_grad (none with another nor with sums:
    // checked)
    const bool rows = in[idx[0]].per_row, sw = in[idx[0]].swiglu, gr = in[idx[0]].swiglu_grad;
    const bool sums = !amax_pass && jobs.j[0].col_sums != nullptr;  // a single job then (checked)
    if (amax_pass && rows) run<fp8_amax_rows_kernel<S>>("fp8_amax_rows_kernel", blocks, jobs, stream);
    else if (amax_pass && sw) run<fp8_amax_kernel<S, kSwigluSrc>>("fp8_amax_kernel", blocks, jobs, stream);
    else if (amax_pass && gr) run<fp8_amax_kernel<S, kGradSrc>>("fp8_amax_kernel", blocks, jobs, stream);
    else if (amax_pass) run<fp8_amax_kernel<S, kPlainSrc>>("fp8_amax_kernel", blocks, jobs, stream);
    else if (rows && sums) run<fp8_cast_rows_kernel<S, true>>("fp8_cast_rows_kernel", blocks, jobs, stream);
    else if (rows) run<fp8_cast_rows_kernel<S, false>>("fp8_cast_rows_kernel", blocks, jobs, stream);
    else if (sums) run<fp8_cast_kernel<S, true, kPlainSrc>>("fp8_cast_kernel", blocks, jobs, stream);
    else if (sw) run<fp8_cast_kernel<S, false, kSwigluSrc>>("fp8_cast_kernel", blocks, jobs, stream);
    else if (gr) run<fp8_cast_kernel<S, false, kGradSrc>>("fp8_cast_kernel", blocks, jobs, stream);
    else run<fp8_cast_kernel<S, false, kPlainSrc>>("fp8_cast_kernel", blocks, jobs, stream);
    if (sums && jobs.j[0].cols > 0) {
      const Job& j = jobs.j[0];
      const unsigned grid = unsigned(cdiv(j.cols, kSumCols));
      fp8_col_sums_kernel<<<grid, kThreads, 0, stream>>>(j.partials, cdiv(j.prows, kTile), j.ldp, j.cols, j.col_sums);
      MMFUSE_CUDA_CHECK_LAUNCH("fp8_col_sums_kernel");
    }
  });
}
}  // namespace

void fp8_quantize_cuda(Fp8QuantJob* jobs, int n, cudaStream_t stream) {
  // the amax pass (a delayed job's blocks return at once unless its history is fresh), then the cast;
  // both tensors in one launch each (a mix of dtypes, recipes or sources launches separately)
  const int all[2] = {0, 1};
  const bool same = n == 1 || (jobs[0].src.dtype == jobs[1].src.dtype && jobs[0].per_row == jobs[1].per_row &&
                               jobs[0].swiglu == jobs[1].swiglu && jobs[0].swiglu_grad == jobs[1].swiglu_grad);
  if (same) {
    launch(jobs, all, n, true, stream);
  } else {
    launch(jobs, all, 1, true, stream);
    launch(jobs, all + 1, 1, true, stream);
  }
  if (same) {
    launch(jobs, all, n, false, stream);
  } else {
    launch(jobs, all, 1, false, stream);
    launch(jobs, all + 1, 1, false, stream);
  }
}

}  // namespace detail
}  // namespace mmfuse
