// CUDA backend of the rotary family: one kernel for text RoPE / mRoPE (both angle sources, all
// layouts, both numerics modes, forward and adjoint) and vision RoPE (per-token angles).
//
// Each block owns `tokens_per_block` consecutive tokens (t = b*L + l). Phase 1 stages, per token and
// half-channel, the four coefficients (P1, Q1, P2, Q2) in shared memory, so each cos/sin is computed
// (or read from the table) once per token, not once per head. Phase 2 walks the (token, head) rows
// of q and k: a thread owns one vector of `vec` half-channels and moves x[j..j+vec) and
// x[j+h..j+h+vec) with one access each, rows unrolled so that several loads are in flight.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/numerics.cuh"
#include "mmfuse/rope.h"

namespace mmfuse {
namespace detail {
namespace {

using cuda::Vec;

// Rows a thread keeps in flight (matches the 4 rows per thread that rope_launch_shape sizes for).
constexpr int kRopeRowsPerThread = 4;

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
  int tokens_per_block, chunks, rows_per_pass;
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

template <class T, int VEC>
__global__ void __launch_bounds__(512) rope_kernel(const RopeArgs a) {
  using C = typename cuda::dcompute<T>::type;
  static_assert(VEC >= 1 && (VEC & (VEC - 1)) == 0, "VEC must be a power of two");
  static_assert(sizeof(T) * VEC <= 16, "one access moves at most 16 bytes");
  extern __shared__ unsigned char smem_raw[];
  const int h = a.half;
  const int TOK = a.tokens_per_block;
  C* sP1 = reinterpret_cast<C*>(smem_raw);  // [TOK, h] each
  C* sQ1 = sP1 + TOK * h;
  C* sP2 = sQ1 + TOK * h;
  C* sQ2 = sP2 + TOK * h;
  const int64_t t0 = int64_t(blockIdx.x) * TOK;
  const bool eager = a.params.numerics == RopeNumerics::kHfEager;

  // Phase 2 mapping: rows (token, head) of q then k; thread = (slot, chunk). The first batch of row
  // loads is issued before phase 1, so the angle work overlaps the memory latency.
  constexpr int U = kRopeRowsPerThread;
  const int chunk = threadIdx.x % a.chunks;
  const int slot = threadIdx.x / a.chunks;
  const int j0 = chunk * VEC;
  const int Hh = a.heads[0] + a.heads[1];
  const int64_t tok_here = min(int64_t(TOK), a.tokens - t0);
  const int rows = int(tok_here) * Hh;
  Vec<T, VEC> lo[U], hi[U];  // [U] rows x (x[j0..j0+VEC), x[j0+h..j0+h+VEC))
  T* dst[U];
  int tl[U];
  auto load_batch = [&](int r0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = r0 + u * a.rows_per_pass;
      dst[u] = nullptr;
      if (slot < a.rows_per_pass && r < rows) {
        tl[u] = r / Hh;
        const int hd = r % Hh;
        const int w = hd < a.heads[0] ? 0 : 1;
        const int head = w == 0 ? hd : hd - a.heads[0];
        const int64_t t = t0 + tl[u];
        const int64_t b = t / a.L, l = t % a.L;
        const T* src = static_cast<const T*>(a.x[w]) + b * a.xs[w][0] + l * a.xs[w][1] + head * a.xs[w][2] + j0;
        dst[u] = static_cast<T*>(a.y[w]) + b * a.ys[w][0] + l * a.ys[w][1] + head * a.ys[w][2] + j0;
        lo[u] = *reinterpret_cast<const Vec<T, VEC>*>(src);
        hi[u] = *reinterpret_cast<const Vec<T, VEC>*>(src + h);
      }
    }
  };
  load_batch(slot);

  // Phase 1: coefficients of this block's tokens.
  for (int e = threadIdx.x; e < TOK * h; e += blockDim.x) {
    const int tl1 = e / h, j = e % h;
    const int64_t t = t0 + tl1;
    if (t >= a.tokens) break;
    const int64_t b = t / a.L, l = t % a.L;
    const int axis = axis_of(a.params, j);
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
    if (eager) {
      c1 = cuda::dround<T>(c1), s1 = cuda::dround<T>(s1);
      c2 = cuda::dround<T>(c2), s2 = cuda::dround<T>(s2);
    }
    const int idx = tl1 * h + j;
    if (!a.params.backward) {
      sP1[idx] = c1, sQ1[idx] = s1, sP2[idx] = c2, sQ2[idx] = s2;
    } else {  // adjoint: dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1
      sP1[idx] = c1, sQ1[idx] = -s2, sP2[idx] = c2, sQ2[idx] = -s1;
    }
  }
  __syncthreads();

  for (int r0 = slot; r0 < rows; r0 += U * a.rows_per_pass) {
    if (r0 != slot) load_batch(r0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (dst[u] == nullptr) continue;
      const int base = tl[u] * h + j0;
      Vec<T, VEC> olo, ohi;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const C x1 = cuda::dload(lo[u].v[e]), x2 = cuda::dload(hi[u].v[e]);
        const C p1 = sP1[base + e], q1 = sQ1[base + e], p2 = sP2[base + e], q2 = sQ2[base + e];
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
      *reinterpret_cast<Vec<T, VEC>*>(dst[u]) = olo;
      *reinterpret_cast<Vec<T, VEC>*>(dst[u] + h) = ohi;
    }
  }
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

template <class T, int VEC>
void launch_vec(const RopeArgs& a, const RopeLaunch& s, cudaStream_t stream) {
  using C = typename cuda::dcompute<T>::type;
  const size_t smem = size_t(4) * s.tokens_per_block * a.half * sizeof(C);
  rope_kernel<T, VEC><<<dim3(unsigned(s.blocks)), dim3(unsigned(s.threads)), smem, stream>>>(a);
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
    using C = typename cuda::dcompute<T>::type;
    const RopeLaunch s = rope_launch_shape(a.tokens, Hh, int(q.shape[3]), int(sizeof(T)), int(sizeof(C)),
                                           max_vec_for(a, int(sizeof(T))));
    a.tokens_per_block = s.tokens_per_block;
    a.chunks = s.chunks;
    a.rows_per_pass = s.rows_per_pass;
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
