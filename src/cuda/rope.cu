// CUDA backend of the rotary family: one general kernel for text RoPE / mRoPE (both angle sources,
// all layouts, both numerics modes, forward and adjoint) and vision RoPE (per-token angles), and a
// token-tile path (sm_90+, below) that vision RoPE takes where its rows allow it.
//
// General kernel: a thread owns one token (t = b*L + l), one vector of `vec` half-channels and one
// group of heads: it stages all of its group's rows of q and k into its own shared-memory slots with
// asynchronous copies, computes (or reads from the table) the cos/sin of its channels once while they
// fly, keeps the coefficients in registers, then rotates each row and stores it. No barrier: every
// thread is an independent stream; the bytes in flight are bounded by shared memory, not registers.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/device_util.cuh"
#include "cuda/numerics.cuh"
#include "cuda/tma.cuh"
#include "backends/rope.h"
#include "mmfuse/rope.h"

namespace mmfuse {
namespace detail {
namespace {

using cuda::Vec;

enum class Source : int { kTableSame, kTableF32, kPosI32, kPosI64, kFreqs };

struct RopeArgs {
  // q / k / outputs: [B, L, H, D], strides in elements (the last dim is contiguous).
  const void* x[2];
  void* y[2];
  int64_t xs[2][3];  // (b, l, head) strides of q, k
  int64_t ys[2][3];  // of q_out, k_out
  int heads[2];      // Hq, Hk
  int64_t L, tokens;
  int half;
  // angles
  Source source;
  const void* cos;
  const void* sin;
  int64_t cs[4], ss[4];  // cos / sin strides (axis, b, l, d)
  const void* pos;
  int64_t ps[3];         // positions strides (axis, b, l)
  const float* inv_freq;
  int64_t fs;            // inv_freq stride
  const float* freqs;
  int64_t frs[3];        // freqs strides (b, l, j)
  RopeParams params;
  // launch shape
  int tokens_per_block, chunks, heads_per_group, rows_in_flight;
  bool table_vec;  // cos/sin rows of q's dtype, contiguous and aligned, one axis per vector: vector loads
};

__device__ __forceinline__ int axis_of(const RopeParams& p, int j) {
  switch (p.layout) {
    case RopeLayout::kSectioned: return j < p.section[0] ? 0 : (j < p.section[0] + p.section[1] ? 1 : 2);
    case RopeLayout::kInterleaved:
      if (j % 3 == 1 && j < 3 * p.section[1]) return 1;
      if (j % 3 == 2 && j < 3 * p.section[2]) return 2;
      return 0;
    default: return 0;
  }
}

template <class T, class C>
__device__ __forceinline__ C table_load(const RopeArgs& a, const void* base, const int64_t* st, int axis, int64_t b,
                                        int64_t l, int i) {
  const int64_t off = axis * st[0] + b * st[1] + l * st[2] + int64_t(i) * st[3];
  if (a.source == Source::kTableF32) return C(static_cast<const float*>(base)[off]);
  return C(cuda::dload(static_cast<const T*>(base)[off]));
}

// Coefficients of one half-channel: y1 = x1*P1 - x2*Q1, y2 = x2*P2 + x1*Q2.
template <class T, class C>
__device__ __forceinline__ void coefficients(const RopeArgs& a, int64_t b, int64_t l, int j, C& P1, C& Q1, C& P2,
                                             C& Q2) {
  const int axis = axis_of(a.params, j);
  const int h = a.half;
  C c1, s1, c2, s2;
  if (a.source == Source::kTableSame || a.source == Source::kTableF32) {
    c1 = table_load<T, C>(a, a.cos, a.cs, axis, b, l, j);
    s1 = table_load<T, C>(a, a.sin, a.ss, axis, b, l, j);
    c2 = table_load<T, C>(a, a.cos, a.cs, axis, b, l, j + h);
    s2 = table_load<T, C>(a, a.sin, a.ss, axis, b, l, j + h);
  } else {
    float angle;
    if (a.source == Source::kFreqs) {
      angle = a.freqs[b * a.frs[0] + l * a.frs[1] + int64_t(j) * a.frs[2]];
    } else {
      const int64_t off = axis * a.ps[0] + b * a.ps[1] + l * a.ps[2];
      const float p = a.source == Source::kPosI32 ? float(static_cast<const int32_t*>(a.pos)[off])
                                                  : float(static_cast<const int64_t*>(a.pos)[off]);
      angle = __fmul_rn(p, a.inv_freq[int64_t(j) * a.fs]);
    }
    C sv, cv;
    cuda::sincos_c(C(angle), &sv, &cv);
    c1 = c2 = cv;
    s1 = s2 = sv;
  }
  if (a.params.numerics == RopeNumerics::kHfEager) {
    c1 = cuda::dround<T>(c1), s1 = cuda::dround<T>(s1);
    c2 = cuda::dround<T>(c2), s2 = cuda::dround<T>(s2);
  }
  if (!a.params.backward) {
    P1 = c1, Q1 = s1, P2 = c2, Q2 = s2;
  } else {  // adjoint: dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1
    P1 = c1, Q1 = -s2, P2 = c2, Q2 = -s1;
  }
}

// Stages `Bytes` bytes from global to shared memory without a register round trip (cp.async on
// sm_80+; 2-byte slots, which cp.async cannot move, go through a register).
template <int Bytes>
__device__ __forceinline__ void stage(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(unsigned(__cvta_generic_to_shared(smem))),
                 "l"(gmem));
    return;
  } else if constexpr (Bytes == 8 || Bytes == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(unsigned(__cvta_generic_to_shared(smem))),
                 "l"(gmem), "n"(Bytes));
    return;
  }
#endif
  struct alignas(Bytes) Raw { unsigned char b[Bytes]; };
  *static_cast<Raw*>(smem) = *static_cast<const Raw*>(gmem);
}

__device__ __forceinline__ void stage_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
}

// One thread = one token x one vector of VEC half-channels x one group of heads. It computes the
// coefficients of its channels once (registers), then moves its group's (token, head) rows of q
// and k: all of them (up to rows_in_flight) are staged at once into the thread's own slots of
// shared memory with asynchronous copies, so many bytes are in flight without holding registers;
// then each row is rotated from shared memory and stored with vector stores. The slots are private
// to the thread ([slot][thread], conflict-free), so there is no barrier.
// Grid: x = token blocks, y = head groups (uniform per block, so the q/k choice never diverges).
// kSym: the angle source gives one cos/sin per half-channel pair (positions, freqs), so P2 == P1
// and Q2 == Q1 and half the coefficient registers suffice.
template <class T, int VEC, bool kSym>
__global__ void __launch_bounds__(512) rope_kernel(const RopeArgs a) {
  using C = typename cuda::compute_type<T>::type;
  using V = Vec<T, VEC>;
  static_assert(VEC >= 1 && (VEC & (VEC - 1)) == 0, "VEC must be a power of two");
  static_assert(sizeof(T) * VEC <= 16, "one access moves at most 16 bytes");
  constexpr int kP2 = kSym ? 0 : 2, kQ2 = kSym ? 1 : 3;
  extern __shared__ unsigned char smem_raw[];
  V* slots = reinterpret_cast<V*>(smem_raw);  // [2 * rows_in_flight][blockDim.x]
  const int nthr = blockDim.x, tid = threadIdx.x;
  const int h = a.half;
  const int chunk = tid % a.chunks;
  const int64_t t = int64_t(blockIdx.x) * a.tokens_per_block + tid / a.chunks;
  if (tid >= a.tokens_per_block * a.chunks || t >= a.tokens) return;
  const int64_t b = t / a.L, l = t - b * a.L;
  const int j0 = chunk * VEC;

  const T* xq = static_cast<const T*>(a.x[0]) + b * a.xs[0][0] + l * a.xs[0][1] + j0;
  const T* xk = static_cast<const T*>(a.x[1]) + b * a.xs[1][0] + l * a.xs[1][1] + j0;
  T* yq = static_cast<T*>(a.y[0]) + b * a.ys[0][0] + l * a.ys[0][1] + j0;
  T* yk = static_cast<T*>(a.y[1]) + b * a.ys[1][0] + l * a.ys[1][1] + j0;
  const int Hq = a.heads[0];
  const int hd0 = int(blockIdx.y) * a.heads_per_group;
  const int hd1 = min(hd0 + a.heads_per_group, Hq + a.heads[1]);
  const int R = a.rows_in_flight;
  const bool eager = a.params.numerics == RopeNumerics::kHfEager;

  // The first batch of rows is in flight while the coefficients are computed.
  auto issue = [&](int r0) {
#pragma unroll
    for (int u = 0; u < kRopeMaxRowsInFlight; ++u) {
      const int hd = r0 + u;
      if (u < R && hd < hd1) {
        const T* src = hd < Hq ? xq + hd * a.xs[0][2] : xk + (hd - Hq) * a.xs[1][2];
        stage<sizeof(V)>(&slots[(2 * u) * nthr + tid], src);
        stage<sizeof(V)>(&slots[(2 * u + 1) * nthr + tid], src + h);
      }
    }
  };
  issue(hd0);

  C coef[kSym ? 2 : 4][VEC];  // P1, Q1, P2, Q2
  if (!kSym && a.table_vec) {  // one vector load per table row (values already in T: no rounding)
    const int axis = axis_of(a.params, j0);
    const int64_t oc = axis * a.cs[0] + b * a.cs[1] + l * a.cs[2] + j0;
    const int64_t os = axis * a.ss[0] + b * a.ss[1] + l * a.ss[2] + j0;
    const T* cp = static_cast<const T*>(a.cos);
    const T* sp = static_cast<const T*>(a.sin);
    const V c1 = *reinterpret_cast<const V*>(cp + oc), c2 = *reinterpret_cast<const V*>(cp + oc + h);
    const V s1 = *reinterpret_cast<const V*>(sp + os), s2 = *reinterpret_cast<const V*>(sp + os + h);
    const C sign = a.params.backward ? C(-1) : C(1);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      coef[0][e] = cuda::dload(c1.v[e]);
      coef[kP2][e] = cuda::dload(c2.v[e]);
      // forward: Q1 = s1, Q2 = s2; adjoint: Q1 = -s2, Q2 = -s1 (negation is exact)
      coef[1][e] = sign * cuda::dload(a.params.backward ? s2.v[e] : s1.v[e]);
      coef[kQ2][e] = sign * cuda::dload(a.params.backward ? s1.v[e] : s2.v[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      C p1, q1, p2, q2;
      coefficients<T, C>(a, b, l, j0 + e, p1, q1, p2, q2);
      coef[0][e] = p1, coef[1][e] = q1, coef[kP2][e] = p2, coef[kQ2][e] = q2;
    }
  }

  for (int r0 = hd0; r0 < hd1; r0 += R) {
    if (r0 != hd0) issue(r0);
    stage_wait();
#pragma unroll
    for (int u = 0; u < kRopeMaxRowsInFlight; ++u) {
      const int hd = r0 + u;
      if (u >= R || hd >= hd1) break;
      const V lo = slots[(2 * u) * nthr + tid], hi = slots[(2 * u + 1) * nthr + tid];
      V olo, ohi;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const C x1 = cuda::dload(lo.v[e]), x2 = cuda::dload(hi.v[e]);
        const C p1 = coef[0][e], q1 = coef[1][e], p2 = coef[kP2][e], q2 = coef[kQ2][e];
        C y1, y2;
        if (eager) {
          y1 = cuda::sub_rn(cuda::dround<T>(cuda::mul_rn(x1, p1)), cuda::dround<T>(cuda::mul_rn(x2, q1)));
          y2 = cuda::add_rn(cuda::dround<T>(cuda::mul_rn(x2, p2)), cuda::dround<T>(cuda::mul_rn(x1, q2)));
        } else {
          y1 = cuda::sub_rn(cuda::mul_rn(x1, p1), cuda::mul_rn(x2, q1));
          y2 = cuda::add_rn(cuda::mul_rn(x2, p2), cuda::mul_rn(x1, q2));
        }
        olo.v[e] = cuda::dstore<T>(y1);
        ohi.v[e] = cuda::dstore<T>(y2);
      }
      T* dst = hd < Hq ? yq + hd * a.ys[0][2] : yk + (hd - Hq) * a.ys[1][2];
      *reinterpret_cast<V*>(dst) = olo;
      *reinterpret_cast<V*>(dst + h) = ohi;
    }
  }
}

// ---- Token-tile path (sm_90+) -------------------------------------------------------------------
// Per-token angles (vision RoPE: the freqs source) in fp32 numerics, on q/k whose rows of one token
// are contiguous (head stride == D) and 16-byte aligned. A persistent block owns tiles of
// kTileTokens tokens (tiles strided by the grid). Its thread 0 stages a whole tile -- the token's q
// row, k row and angle row, one 1-D bulk copy (TMA) each, completing on the stage's mbarrier --
// kTileStages - 1 tiles ahead; all threads then compute the tile's cos/sin once into a shared
// table, rotate the staged rows in place and thread 0 writes them back with bulk stores. A few large
// copies per token instead of a thread per 16 bytes: the copy engine keeps the bytes in flight and
// the SM only does the arithmetic. Bitwise equal to rope_kernel (same operations in the same order).
constexpr int kTileTokens = 2, kTileStages = 2, kTileThreads = 128;
constexpr size_t kTileMaxSmem = 48 * 1024;  // the default dynamic shared-memory limit: no opt-in

struct TileArgs {
  const void* x[2];
  void* y[2];
  int64_t xs[2][2], ys[2][2];  // (b, l) strides of q, k and of q_out, k_out, in elements
  int bytes[2];                // bytes of one token's q rows, k rows (heads * D * elem)
  const float* freqs;
  int64_t frs[2];              // freqs (b, l) strides; the last dim is contiguous
  int64_t L, tokens;
  int hv;                      // 16-byte vectors per half head
  bool backward;
};

// Bytes of one coefficient group: (cos, sin) of the EV channels of one 16-byte vector, padded by 16
// bytes so that the groups a quarter-warp reads start in distinct banks.
template <class T>
constexpr int tile_group_bytes() { return int(16 / sizeof(T)) * 8 + 16; }

template <class T>
size_t tile_smem(const TileArgs& a) {
  const int half = a.hv * int(16 / sizeof(T));
  return size_t(kTileStages) * kTileTokens * (a.bytes[0] + a.bytes[1] + half * 4) +
         size_t(kTileTokens) * a.hv * tile_group_bytes<T>();
}

using cuda::bulk_load;
using cuda::bulk_store;
using cuda::mbar_wait;
using cuda::smem_addr;

// The tile's cos/sin into the table cs ([token][vector] groups), then every 16-byte vector pair
// (x[j], x[j + h]) of the staged rows rotated in place.
template <class T, int HV>
__device__ __forceinline__ void tile_rotate(const TileArgs& a, unsigned char* rows, const float* fr,
                                            unsigned char* cs, int nt, int W) {
  using C = typename cuda::compute_type<T>::type;
  constexpr int EV = int(16 / sizeof(T)), G = tile_group_bytes<T>();
  using V = Vec<T, EV>;
  const int hv = HV > 0 ? HV : a.hv, half = hv * EV, tid = threadIdx.x, nthr = blockDim.x;
  for (int i = tid; i < nt * half; i += nthr) {
    float sv, cv;
    cuda::sincos_c(fr[i], &sv, &cv);
    const int t = i / half, j = i - t * half;
    *reinterpret_cast<float2*>(cs + (t * hv + j / EV) * G + (j % EV) * 8) = make_float2(cv, a.backward ? -sv : sv);
  }
  __syncthreads();
  const int per_tok = W / (2 * half * int(sizeof(T))) * hv;  // (head row, vector) items of one token
  for (int i = tid; i < nt * per_tok; i += nthr) {
    const int t = i / per_tok, r = i - t * per_tok, row = r / hv, v = r - row * hv;
    unsigned char* p = rows + t * W + (row * 2 * half + v * EV) * int(sizeof(T));
    V* lo = reinterpret_cast<V*>(p);
    V* hi = reinterpret_cast<V*>(p + half * sizeof(T));
    const V x1 = *lo, x2 = *hi;
    float4 c4[EV / 2];
    const float4* g = reinterpret_cast<const float4*>(cs + (t * hv + v) * G);
#pragma unroll
    for (int u = 0; u < EV / 2; ++u) c4[u] = g[u];
    const float* cf = reinterpret_cast<const float*>(c4);
    V y1, y2;
#pragma unroll
    for (int e = 0; e < EV; ++e) {
      const C a1 = cuda::dload(x1.v[e]), a2 = cuda::dload(x2.v[e]), c = cf[2 * e], sn = cf[2 * e + 1];
      y1.v[e] = cuda::dstore<T>(cuda::sub_rn(cuda::mul_rn(a1, c), cuda::mul_rn(a2, sn)));
      y2.v[e] = cuda::dstore<T>(cuda::add_rn(cuda::mul_rn(a2, c), cuda::mul_rn(a1, sn)));
    }
    *lo = y1;
    *hi = y2;
  }
}

template <class T, int HV>
__global__ void __launch_bounds__(kTileThreads) rope_tile_kernel(const TileArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bar[kTileStages];
  constexpr int TOK = kTileTokens, S = kTileStages, E = int(sizeof(T));
  const int hv = HV > 0 ? HV : a.hv, half = hv * (16 / E);
  const int W = a.bytes[0] + a.bytes[1], fsb = half * 4, stage_bytes = TOK * (W + fsb);
  unsigned char* cs = smem_raw + S * stage_bytes;
  const int64_t ntiles = (a.tokens + TOK - 1) / TOK, stride = gridDim.x;
  const int tid = threadIdx.x;
  auto tile_tokens = [&](int64_t tile) { return int(min(int64_t(TOK), a.tokens - tile * TOK)); };
  if (tid == 0) {
    for (int i = 0; i < S; ++i)
      cuda::mbar_init(&bar[i], 1);
    cuda::fence_mbar_init();
  }
  __syncthreads();
  auto prefetch = [&](int64_t tile, int s) {  // thread 0
    unsigned char* st = smem_raw + s * stage_bytes;
    const int nt = tile_tokens(tile);
    cuda::mbar_arrive_expect_tx(&bar[s], unsigned(nt * (W + fsb)));
    for (int t = 0; t < nt; ++t) {
      const int64_t n = tile * TOK + t, b = n / a.L, l = n - b * a.L;
      int off = t * W;
      for (int w = 0; w < 2; ++w) {
        if (a.bytes[w] == 0) continue;
        const T* src = static_cast<const T*>(a.x[w]) + b * a.xs[w][0] + l * a.xs[w][1];
        bulk_load(st + off, src, a.bytes[w], &bar[s]);
        off += a.bytes[w];
      }
      bulk_load(st + TOK * W + t * fsb, a.freqs + b * a.frs[0] + l * a.frs[1], fsb, &bar[s]);
    }
  };
  if (tid == 0)
    for (int p = 0; p < S - 1; ++p)
      if (blockIdx.x + p * stride < ntiles) prefetch(blockIdx.x + p * stride, p);
  unsigned phase = 0;  // bit s: the parity stage s waits for next
  int s = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += stride) {
    const int64_t ahead = tile + (S - 1) * stride;
    if (tid == 0 && ahead < ntiles) {
      // The stage to refill held the previous tile: its bulk stores must have read it.
      cuda::bulk_wait_read<0>();
      prefetch(ahead, (s + S - 1) % S);
    }
    mbar_wait(&bar[s], (phase >> s) & 1u);
    phase ^= 1u << s;
    unsigned char* st = smem_raw + s * stage_bytes;
    const int nt = tile_tokens(tile);
    tile_rotate<T, HV>(a, st, reinterpret_cast<const float*>(st + TOK * W), cs, nt, W);
    cuda::fence_proxy_async();  // the rotated rows, to the copy engine
    __syncthreads();
    if (tid == 0) {
      for (int t = 0; t < nt; ++t) {
        const int64_t n = tile * TOK + t, b = n / a.L, l = n - b * a.L;
        int off = t * W;
        for (int w = 0; w < 2; ++w) {
          if (a.bytes[w] == 0) continue;
          bulk_store(static_cast<T*>(a.y[w]) + b * a.ys[w][0] + l * a.ys[w][1], st + off, a.bytes[w]);
          off += a.bytes[w];
        }
      }
      cuda::bulk_commit();
    }
    s = (s + 1) % S;
  }
  if (tid == 0) cuda::bulk_wait_all();
#else
  __trap();  // never launched: the host checks kernel_arch
#endif
}

template <class T>
auto tile_kernel(const TileArgs& t) {
  return t.hv == 5 ? rope_tile_kernel<T, 5>
       : t.hv == 4 ? rope_tile_kernel<T, 4>
       : t.hv == 8 ? rope_tile_kernel<T, 8>
                   : rope_tile_kernel<T, 0>;
}

// The token-tile path's arguments when it can take the call (conditions above; the kernel's
// machine code is sm_90+), else false.
template <class T>
bool tile_args(const RopeArgs& a, int64_t B, int D, TileArgs& t) {
  constexpr int E = int(sizeof(T)), EV = 16 / E;
  if (a.source != Source::kFreqs || a.params.numerics != RopeNumerics::kFp32 || a.half % EV != 0) return false;
  if (a.frs[2] != 1 || reinterpret_cast<uintptr_t>(a.freqs) % 16 != 0) return false;
  if ((B > 1 && a.frs[0] * 4 % 16 != 0) || (a.L > 1 && a.frs[1] * 4 % 16 != 0)) return false;
  for (int w = 0; w < 2; ++w) {
    t.bytes[w] = a.heads[w] * D * E;
    t.x[w] = a.x[w], t.y[w] = a.y[w];
    for (int d = 0; d < 2; ++d) t.xs[w][d] = a.xs[w][d], t.ys[w][d] = a.ys[w][d];
    if (a.heads[w] == 0) continue;
    if (a.heads[w] > 1 && (a.xs[w][2] != D || a.ys[w][2] != D)) return false;
    if (reinterpret_cast<uintptr_t>(a.x[w]) % 16 != 0 || reinterpret_cast<uintptr_t>(a.y[w]) % 16 != 0) return false;
    if (B > 1 && (a.xs[w][0] * E % 16 != 0 || a.ys[w][0] * E % 16 != 0)) return false;
    if (a.L > 1 && (a.xs[w][1] * E % 16 != 0 || a.ys[w][1] * E % 16 != 0)) return false;
  }
  t.freqs = a.freqs;
  t.frs[0] = a.frs[0], t.frs[1] = a.frs[1];
  t.L = a.L, t.tokens = a.tokens;
  t.hv = a.half / EV;
  t.backward = a.params.backward;
  return tile_smem<T>(t) <= kTileMaxSmem && cuda::kernel_arch(reinterpret_cast<const void*>(tile_kernel<T>(t))) >= 90;
}

template <class T>
void launch_tile(const TileArgs& t, cudaStream_t stream) {
  const auto kernel = tile_kernel<T>(t);
  const size_t smem = tile_smem<T>(t);
  const int64_t tiles = (t.tokens + kTileTokens - 1) / kTileTokens;
  const int64_t resident = cuda::resident_blocks(reinterpret_cast<const void*>(kernel), kTileThreads, smem);
  const unsigned grid = unsigned(std::max<int64_t>(1, std::min(tiles, resident)));
  kernel<<<grid, kTileThreads, smem, stream>>>(t);
  MMFUSE_CUDA_CHECK_LAUNCH("rope_tile_kernel");
}

// Largest power-of-two elements-per-access (<= 16 bytes) that every pointer and stride allows.
int max_vec_for(const RopeArgs& a, int elem) {
  int vec = 16 / elem;
  auto fits = [&](int64_t v) { return v % vec == 0; };
  for (; vec > 1; vec /= 2) {
    bool ok = true;
    for (int w = 0; w < 2; ++w) {
      if (a.heads[w] == 0) continue;
      ok = ok && reinterpret_cast<uintptr_t>(a.x[w]) % (vec * elem) == 0 &&
           reinterpret_cast<uintptr_t>(a.y[w]) % (vec * elem) == 0;
      for (int d = 0; d < 3; ++d) ok = ok && fits(a.xs[w][d]) && fits(a.ys[w][d]);
    }
    if (ok) break;
  }
  return vec;
}

// The cos/sin tables can be read one vector (s.vec entries) at a time: contiguous, aligned, and
// every vector of half-channels within one axis (never true of the interleaved layout).
bool table_vectorizable(const RopeArgs& a, const RopeAngles& ang, int vec, int elem) {
  if (vec == 1) return false;
  if (a.params.layout == RopeLayout::kInterleaved) return false;
  if (a.params.layout == RopeLayout::kSectioned &&
      (a.params.section[0] % vec != 0 || (a.params.section[0] + a.params.section[1]) % vec != 0))
    return false;
  for (const TensorView* t : {&ang.cos, &ang.sin}) {
    if (t->stride[3] != 1 || reinterpret_cast<uintptr_t>(t->data) % (vec * elem) != 0) return false;
    for (int d = 0; d < 3; ++d)
      if (t->stride[d] % vec != 0) return false;
  }
  return true;
}

template <class T, int VEC>
void launch_vec(const RopeArgs& a, const RopeLaunch& s, cudaStream_t stream) {
  const dim3 grid(unsigned(s.blocks), unsigned(s.head_groups)), block(unsigned(s.threads));
  const size_t smem = size_t(2) * s.rows_in_flight * s.threads * sizeof(Vec<T, VEC>);
  const bool sym = a.source != Source::kTableSame && a.source != Source::kTableF32;
  if (sym) {
    rope_kernel<T, VEC, true><<<grid, block, smem, stream>>>(a);
  } else {
    rope_kernel<T, VEC, false><<<grid, block, smem, stream>>>(a);
  }
  MMFUSE_CUDA_CHECK_LAUNCH("rope_kernel");
}

}  // namespace

void mrope_cuda(const TensorView& q, const TensorView& k, const RopeAngles& ang, const RopeParams& p,
                TensorView& q_out, TensorView& k_out, cudaStream_t stream) {
  RopeArgs a{};
  const TensorView* xs[2] = {&q, &k};
  const TensorView* ys[2] = {&q_out, &k_out};
  for (int w = 0; w < 2; ++w) {
    a.x[w] = xs[w]->data;
    a.y[w] = ys[w]->data;
    a.heads[w] = int(xs[w]->shape[2]);
    for (int d = 0; d < 3; ++d) {
      a.xs[w][d] = xs[w]->stride[d];
      a.ys[w][d] = ys[w]->stride[d];
    }
  }
  a.L = q.shape[1];
  a.tokens = q.shape[0] * q.shape[1];
  a.half = int(q.shape[3] / 2);
  a.params = p;
  if (ang.cos.defined()) {
    a.source = ang.cos.dtype == DType::kFloat32 && q.dtype != DType::kFloat32 ? Source::kTableF32 : Source::kTableSame;
    MMFUSE_CHECK(ang.cos.dtype == ang.sin.dtype, "mrope: cos and sin must have one dtype, got ",
                 dtype_name(ang.cos.dtype), " and ", dtype_name(ang.sin.dtype));
    a.cos = ang.cos.data;
    a.sin = ang.sin.data;
    for (int d = 0; d < 4; ++d) a.cs[d] = ang.cos.stride[d], a.ss[d] = ang.sin.stride[d];
  } else if (ang.positions.defined()) {
    a.source = ang.positions.dtype == DType::kInt32 ? Source::kPosI32 : Source::kPosI64;
    a.pos = ang.positions.data;
    for (int d = 0; d < 3; ++d) a.ps[d] = ang.positions.stride[d];
    a.inv_freq = ang.inv_freq.ptr<float>();
    a.fs = ang.inv_freq.stride[0];
  } else {
    a.source = Source::kFreqs;
    a.freqs = ang.freqs.ptr<float>();
    for (int d = 0; d < 3; ++d) a.frs[d] = ang.freqs.stride[d];
  }
  const int Hh = a.heads[0] + a.heads[1];
  dispatch_floating(q.dtype, "q", [&](auto tag) {
    using T = typename cuda::device_type<typename decltype(tag)::type>::type;
    if constexpr (sizeof(T) <= 4) {
      TileArgs t{};
      if (tile_args<T>(a, q.shape[0], int(q.shape[3]), t)) {
        launch_tile<T>(t, stream);
        return;
      }
    }
    const RopeLaunch s = rope_launch_shape(a.tokens, Hh, int(q.shape[3]), int(sizeof(T)), max_vec_for(a, int(sizeof(T))));
    a.table_vec = a.source == Source::kTableSame && table_vectorizable(a, ang, s.vec, int(sizeof(T)));
    a.tokens_per_block = s.tokens_per_block;
    a.chunks = s.chunks;
    a.heads_per_group = s.heads_per_group;
    a.rows_in_flight = s.rows_in_flight;
    MMFUSE_CHECK(s.rows_in_flight >= 1 && s.rows_in_flight <= kRopeMaxRowsInFlight,
                 "mrope: internal error: rows in flight ", s.rows_in_flight);
    MMFUSE_CHECK(s.blocks < (int64_t(1) << 31), "mrope: too many tokens for one launch: ", a.tokens);
    switch (s.vec) {
      case 8: if constexpr (16 / sizeof(T) >= 8) { launch_vec<T, 8>(a, s, stream); return; } break;
      case 4: if constexpr (16 / sizeof(T) >= 4) { launch_vec<T, 4>(a, s, stream); return; } break;
      case 2: launch_vec<T, 2>(a, s, stream); return;
      case 1: launch_vec<T, 1>(a, s, stream); return;
    }
    MMFUSE_FAIL("mrope: internal error: unsupported vector width ", s.vec);
  });
}

}  // namespace detail
}  // namespace mmfuse
