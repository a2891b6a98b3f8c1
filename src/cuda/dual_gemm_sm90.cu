// CUDA backend of the dual-expert GEMM, second path: one persistent sm_90a kernel over the output
// tiles of both problems (issue 5). The work unit is a pair of vertically adjacent 128 x 256 tiles,
// computed by a cluster of two CTAs (one an SM) that share the pair's B tile: each CTA copies half
// of it into both CTAs' shared memory (TMA multicast). The unit list puts the problem with the
// costlier units (larger k; then more units) first, so that the other problem's units fill the first
// one's last partial wave instead of running after it. Static schedules over it
// (dual_gemm_sm90_schedule.h): whole units round robin ("tiles"); or that for all but the last one
// to two waves, then an equal share of the remaining k-blocks a cluster ("stream-K"). A unit cut
// between clusters is summed in a fixed order through fp32 partials in the caller's workspace and
// flags tagged with the launch (no zeroing needed).
//
// A CTA is three warpgroups: warpgroup 0 is the producer (one thread issues the TMA bulk tensor
// copies of A and B into a ring of kStages shared-memory stages, each completing on its stage's
// "full" mbarrier), warpgroups 1 and 2 are the consumers (each computes 64 rows of the 128 x 256
// tile with m64n256k16 wgmma from shared memory, releases a stage on the "empty" mbarriers of both
// CTAs once its wgmma have read it, and stores its fp32 accumulators, rounded once). Registers move
// from the producer to the consumers with setmaxnreg.
//
// Two epilogues. Where every output is 16-bit (the input dtype) with rows of a multiple of 16 bytes,
// each consumer warpgroup writes its 64 x 256 block a half at a time with stmatrix into its own
// 16 KB staging buffer (128-byte swizzle, conflict-free) and one thread stores each half with TMA
// (`cp.async.bulk.tensor`, clipped at the output's edges), waited for only before the buffer's next
// use. The second half waits for the first half's read of the buffer, so it is held in registers
// (32 packed pairs a thread) and written during the next segment's second k-block, while that
// segment's wgmma run. Otherwise (fp32 outputs, accumulation, other row lengths) the accumulators go
// straight from registers to global memory.
//
// Layouts: K-major operands (a [m, k], w [n, k]) arrive as 64-wide (128-byte) boxes of rows;
// M/N-major ones (a [k, m] with trans_a, w [k, n] without trans_b) as 64 x 64 boxes side by side,
// read by wgmma with its transpose flag. All four use the 128-byte swizzle. TMA zero-fills what lies
// outside the operands, so ragged m, n and k need no masking in the main loop; the epilogue masks.
//
// The kernel needs 16-byte-aligned operands with row strides a multiple of 16 bytes (TMA) and an
// sm_90a cubin; dual_gemm.cu asks sm90_dual_gemm_supported() and otherwise uses the cuBLASLt path.
// Measured (docs/benchmarks.md): with the register epilogue only, 0.3-0.9x of the cuBLASLt path (H200,
// 2026-12-04 21:10-21:21; those stores cost 18-37 % of its time); with the TMA epilogue, the held
// half and the auto schedule (H100, 2026-12-05 21:28) 1.01-1.02x on the tiny-small forward and dW
// and the VLA down dW, 0.86-0.97x elsewhere: wins within the spread between runs, so the path
// heuristic does not pick it yet.
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/env.h"
#include "cuda/device_util.cuh"
#include "cuda/dual_gemm_sm90.h"
#include "cuda/dual_gemm_sm90_schedule.h"
#include "cuda/tma.cuh"

namespace mmfuse {
namespace detail {
namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4, kThreads = 384;
constexpr int kCluster = 2;  // CTAs a cluster: the two tiles of a unit, sharing B
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
// The TMA epilogue stages each consumer warpgroup's 64 x 256 block of 16-bit outputs a half at a
// time: two 64 x 64 boxes in the 128-byte swizzle, 16 KB a warpgroup (the whole block would leave
// room for only 3 ring stages, which cost more than the wait between the halves: docs/benchmarks.md,
// 2026-12-05 19:25).
constexpr int kOutBoxBytes = 64 * 64 * 2, kOutBytes = 2 * kOutBoxBytes;
template <bool kTmaOut>
constexpr int kSmemBytes = kStages * kStageBytes + (kTmaOut ? 2 * kOutBytes : 0) +
                           1024 /* 1024-byte alignment of the swizzled tiles */ + 2 * kStages * 8 /* barriers */;

enum OutKind : int { kOutInput = 0, kOutFloat = 1, kOutFloatAccumulate = 2 };

// The work unit is a pair of vertically adjacent tiles (rows 256 u .. 256 u + 255, 256 columns),
// one for each CTA of a cluster of two.
struct Problem {
  int m, n, pairs_m;  // pairs_m: units along m
  int out_kind;
  void* out;
};

struct Params {
  Problem p[2];  // in schedule order: p[0]'s units first
  Schedule s;
  float* partial;             // s.slots: kPartialFloats a workspace part
  unsigned long long* flags;  // s.slots: a flag a part, this launch's token once the part's partial is written
};

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MMFUSE_SM90A 1
#endif

#ifdef MMFUSE_SM90A
constexpr int kBox = 64 * 64 * 2;  // one 64 x 64 box of an M/N-major operand

// Shared-memory addresses, mbarrier set-up and the expect_tx arrival come from cuda/tma.cuh; this
// file's mbar_wait stays its own (its loop compiles to other instructions than cuda::mbar_wait's,
// and changing what ran needs a GPU run).
//
// Arrives on the barrier at bar's offset in the shared memory of cluster CTA `rank` (the default
// .release.cta semantics: a .cluster-scope release would fence all of the thread's global stores).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(cuda::smem_addr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(cuda::smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// One 2-D box of a tensor map into shared memory; completes `bar`'s transaction bytes. c0 is the
// inner (contiguous) coordinate.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          cuda::smem_addr(dst)),
      "l"(map), "r"(cuda::smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// The same box into the same offset of both CTAs of the cluster, completing on each one's `bar`.
__device__ __forceinline__ void tma_load_both(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(cuda::smem_addr(dst)),
      "l"(map), "r"(cuda::smem_addr(bar)), "r"(c0), "r"(c1), "h"(uint16_t(3))
      : "memory");
}

// A 2-D box from shared memory to global memory through a tensor map (what lies outside the tensor is
// not written), in this thread's current bulk-async group.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map), "r"(c0),
               "r"(c1), "r"(src)
               : "memory");
}
// Barrier `id` (1, 2, ...: 0 is __syncthreads) of `count` threads.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Four 8 x 8 matrices of 16-bit values to shared memory: lanes 8 i .. 8 i + 7 give the addresses of
// matrix i's rows; v[i] is this lane's pair of matrix i (row lane / 4, columns 2 (lane % 4) + 0, 1).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]),
               "r"(v[2]), "r"(v[3])
               : "memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle: start, leading and stride byte offsets.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma fence or wait.
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The 128 accumulators of one m64n256k16 wgmma (the fragment layout of PTX's "wgmma .m64nNk16 D").
#define MMFUSE_WGMMA_N256(TYPE)                                                                        \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                    \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"                                                                   \
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"                                                      \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                           \
      : "l"(da), "l"(db), "r"(scale_d), "n"(int(TA)), "n"(int(!TB)))

// d (+)= A[64 x 16] B[16 x 256] from shared memory; scale_d = 0 overwrites d.
template <class T, bool TA, bool TB>
__device__ __forceinline__ void wgmma_n256(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MMFUSE_WGMMA_N256("bf16");
  else
    MMFUSE_WGMMA_N256("f16");
}
#undef MMFUSE_WGMMA_N256

// A block wholly inside an output with even n: no bounds checks, a pair a store.
template <class O, bool kAdd>
__device__ __forceinline__ void store_full(const float (&d)[128], O* out, int n, int r0, int c0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    O* row = out + size_t(r0 + 8 * h) * size_t(n) + c0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
      if constexpr (std::is_same_v<O, float>) {
        float2 v = make_float2(v0, v1);
        if constexpr (kAdd) {
          const float2 old = *reinterpret_cast<const float2*>(row + 8 * j);
          v = make_float2(__fadd_rn(old.x, v0), __fadd_rn(old.y, v1));
        }
        *reinterpret_cast<float2*>(row + 8 * j) = v;
      } else if constexpr (std::is_same_v<O, __nv_bfloat16>) {
        *reinterpret_cast<__nv_bfloat162*>(row + 8 * j) = __floats2bfloat162_rn(v0, v1);
      } else {
        *reinterpret_cast<__half2*>(row + 8 * j) = __floats2half2_rn(v0, v1);
      }
    }
  }
}

// Stores (or adds) a thread's accumulators: fragment element 4j + 2h + c is row 16 w + l / 4 + 8 h,
// column 8 j + 2 (l % 4) + c of the warpgroup's 64 x 256 block (warp w, lane l).
template <class T>
__device__ __forceinline__ void store_tile(const float (&d)[128], const Problem& p, int row0, int col0) {
  const int out_kind = p.out_kind;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int r0 = row0 + 16 * warp + lane / 4, c0 = col0 + 2 * (lane % 4);
  const bool pairs = (p.n % 2) == 0;  // even n: a (row, even column) pair is aligned and in bounds
  if (pairs && row0 + 64 <= p.m && col0 + kBN <= p.n) {
    if (out_kind == kOutInput)
      store_full<T, false>(d, static_cast<T*>(p.out), p.n, r0, c0);
    else if (out_kind == kOutFloat)
      store_full<float, false>(d, static_cast<float*>(p.out), p.n, r0, c0);
    else
      store_full<float, true>(d, static_cast<float*>(p.out), p.n, r0, c0);
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= p.m) continue;
    const size_t row = size_t(r) * size_t(p.n);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int c = c0 + 8 * j;
      if (c >= p.n) continue;
      const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
      const bool two = c + 1 < p.n;
      if (out_kind == kOutInput) {
        T* o = static_cast<T*>(p.out) + row + c;
        if (pairs) {
          if constexpr (std::is_same_v<T, __nv_bfloat16>)
            *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
          else
            *reinterpret_cast<__half2*>(o) = __floats2half2_rn(v0, v1);
        } else {
          o[0] = T(v0);
          if (two) o[1] = T(v1);
        }
      } else {
        float* o = static_cast<float*>(p.out) + row + c;
        const bool acc = out_kind == kOutFloatAccumulate;
        if (pairs) {
          float2 v = make_float2(v0, v1);
          if (acc) {
            const float2 old = *reinterpret_cast<const float2*>(o);
            v.x = __fadd_rn(old.x, v0);
            v.y = __fadd_rn(old.y, v1);
          }
          *reinterpret_cast<float2*>(o) = v;
        } else {
          o[0] = acc ? __fadd_rn(o[0], v0) : v0;
          if (two) o[1] = acc ? __fadd_rn(o[1], v1) : v1;
        }
      }
    }
  }
}

// Two floats rounded to T (bf16 or fp16), packed: the first at the lower address.
template <class T>
__device__ __forceinline__ uint32_t pack2(float v0, float v1) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
    memcpy(&u, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(v0, v1);
    memcpy(&u, &h, 4);
  }
  return u;
}

// The TMA epilogue of consumer warpgroup c writes its 64 x 256 block, rounded once, a half (64 x
// 128) at a time through its 16 KB staging buffer `buf` (two 64 x 64 boxes, 128-byte swizzle: the
// 16-byte chunk q of row r at r * 128 + ((q ^ (r % 8)) * 16), so that each stmatrix writes 8 rows in
// distinct banks); one thread stores the boxes that lie inside the output. Half h's packed pairs:
// pair 2 j + i (j < 16, i < 2) holds fragment elements 4 (16 h + j) + 2 i + {0, 1}.
template <class T>
__device__ __forceinline__ uint32_t packed_pair(const float (&d)[128], int half, int p) {
  const int jj = 16 * half + p / 2, i = p % 2;
  return pack2<T>(d[4 * jj + 2 * i], d[4 * jj + 2 * i + 1]);
}

// One half through the staging buffer: waits until the buffer's previous stores have read it, writes
// the 32 packed pairs that get(p) returns, and stores the half's boxes at columns col0 .. col0 + 127
// (in this thread's bulk-async group; waited for only before the buffer's next use).
template <class Get>
__device__ __forceinline__ void store_half_tma(Get get, unsigned char* buf, const CUtensorMap* map, int n, int row0,
                                               int col0, int c) {
  constexpr int kBoxes = 2;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const uint32_t base = cuda::smem_addr(buf);
  const int i = lane / 8, rr = lane % 8;       // the matrix this lane addresses, and its row in it
  const int r = 16 * warp + 8 * (i % 2) + rr;  // matrix i of step j: rows 8 (i % 2), columns 8 (j + i / 2)
  if (tid == 0) cuda::bulk_wait_read<0>();     // the buffer's previous stores have read it
  named_barrier(1 + c, 128);
#pragma unroll
  for (int j = 0; j < 8 * kBoxes; j += 2) {
    const uint32_t v[4] = {get(2 * j), get(2 * j + 1), get(2 * j + 2), get(2 * j + 3)};
    const int jj = j + i / 2;
    stmatrix_x4(base + (jj / 8) * kOutBoxBytes + r * 128 + (((jj % 8) ^ rr) << 4), v);
  }
  cuda::fence_proxy_async();  // the writes, visible to the TMA unit
  named_barrier(1 + c, 128);
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) {
      const int col = col0 + 64 * b;
      if (col < n) tma_store(map, base + b * kOutBoxBytes, col, row0);
    }
    cuda::bulk_commit();
  }
}

// The second half of a block whose first half is stored: its packed pairs and where they go. Stored
// during the next segment's second k-block (its wgmma run meanwhile), so that the wait for the first
// half's read of the buffer costs the tensor cores nothing.
struct HeldHalf {
  uint32_t pairs[32];
  const CUtensorMap* map;
  int n, row0, col0;
  bool held;
};

template <class T>
__device__ __forceinline__ void store_block_tma(const float (&d)[128], unsigned char* buf, const CUtensorMap* map,
                                                int n, int row0, int col0, int c, HeldHalf& h) {
#pragma unroll
  for (int p = 0; p < 32; ++p) h.pairs[p] = packed_pair<T>(d, 1, p);
  h.map = map;
  h.n = n;
  h.row0 = row0;
  h.col0 = col0 + 128;
  h.held = true;
  store_half_tma([&](int p) { return packed_pair<T>(d, 0, p); }, buf, map, n, row0, col0, c);
}

__device__ __forceinline__ void store_held_half(HeldHalf& h, unsigned char* buf, int c) {
  if (!h.held) return;
  store_half_tma([&](int p) { return h.pairs[p]; }, buf, h.map, h.n, h.row0, h.col0, c);
  h.held = false;
}

struct TileCoord {
  int e, m0, n0;
};
// This CTA's tile of unit u (rank 1 of a pair past the last row reads zeros and stores nothing).
__device__ __forceinline__ TileCoord tile_coord(const Params& prm, int u, uint32_t rank) {
  const int e = u >= prm.s.units[0];
  const int local = e ? u - prm.s.units[0] : u;
  const Problem& p = prm.p[e];
  return {e, (kCluster * (local % p.pairs_m) + int(rank)) * kBM, (local / p.pairs_m) * kBN};
}

// The workspace part of consumer warpgroup c of CTA `rank` in slot `slot`.
static_assert(kPartsPerSlot == kCluster * 2, "a part a consumer warpgroup of each CTA of a cluster");
__device__ __forceinline__ int slot_part(int slot, uint32_t rank, int c) {
  return (slot * kCluster + int(rank)) * 2 + c;
}

// This launch's flag value (never 0, the cleared value): derived from the grid's launch number, so
// that a stale value from an earlier launch never matches; the gathering cluster also clears the
// flags it consumed (a replayed CUDA graph may reuse the workspace).
__device__ __forceinline__ unsigned long long launch_token() {
  unsigned long long id;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(id));
  const unsigned long long t = id ^ 0x9E3779B97F4A7C15ull;
  return t ? t : 1;
}

// Consumer warpgroup c: its fp32 accumulators to workspace part `part`, then the part's flag raised
// (the warpgroup's stores ordered before it: a barrier, then one thread's gpu-scope fence and store).
__device__ __forceinline__ void spill_partial(const float (&d)[128], const Params& prm, int part, int c,
                                              unsigned long long token) {
  const int tid = threadIdx.x % 128;
  float4* dst = reinterpret_cast<float4*>(prm.partial + size_t(part) * kPartialFloats) + tid;
#pragma unroll
  for (int i = 0; i < 32; ++i) __stcg(dst + 128 * i, make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]));
  named_barrier(1 + c, 128);
  if (tid == 0) {
    __threadfence();
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(prm.flags + part), "l"(token) : "memory");
  }
}

// Consumer warpgroup c of CTA `rank`: adds the partials of its unit's other segments (seg's slots,
// in k order), each once its flag is up; clears each flag.
__device__ __forceinline__ void gather_partials(float (&d)[128], const Params& prm, const Segment& seg, uint32_t rank,
                                                int c, unsigned long long token) {
  const int tid = threadIdx.x % 128;
  for (int h = 0; h < seg.partials; ++h) {
    const int part = slot_part(seg.slot + h, rank, c);
    if (tid == 0) {
      unsigned long long f;
      do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(f) : "l"(prm.flags + part) : "memory");
      } while (f != token);
      asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(prm.flags + part), "l"(0ull) : "memory");
    }
    named_barrier(1 + c, 128);
    const float4* src = reinterpret_cast<const float4*>(prm.partial + size_t(part) * kPartialFloats) + tid;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const float4 v = __ldcg(src + 128 * i);
      d[4 * i] += v.x;
      d[4 * i + 1] += v.y;
      d[4 * i + 2] += v.z;
      d[4 * i + 3] += v.w;
    }
  }
}
#endif  // MMFUSE_SM90A

// Tensor maps: a (ma*), w (mw*) and, with the TMA epilogue (kTmaOut: 16-bit outputs), out (mo*) of
// the two problems in schedule order.
template <class T, bool TA, bool TB, bool kTmaOut>
__global__ void __launch_bounds__(kThreads, 1)
    dual_gemm_sm90_kernel(const __grid_constant__ CUtensorMap ma0, const __grid_constant__ CUtensorMap mw0,
                          const __grid_constant__ CUtensorMap ma1, const __grid_constant__ CUtensorMap mw1,
                          const __grid_constant__ CUtensorMap mo0, const __grid_constant__ CUtensorMap mo1,
                          const __grid_constant__ Params prm) {
#ifdef MMFUSE_SM90A
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* out_buf = smem + kStages * kStageBytes;  // kTmaOut: kOutBytes a consumer warpgroup
  uint64_t* full = reinterpret_cast<uint64_t*>(out_buf + (kTmaOut ? 2 * kOutBytes : 0));
  uint64_t* empty = full + kStages;
  const int wg = threadIdx.x / 128;
  const uint32_t rank = cluster_rank();
  const int cluster = blockIdx.x / kCluster;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cuda::mbar_init(&full[s], 1);    // the producer's expect_tx arrival (plus the TMA bytes of both CTAs)
      cuda::mbar_init(&empty[s], 8 * kCluster);  // one arrival from each consumer warp of both CTAs
    }
    cuda::fence_mbar_init();
  }
  cluster_sync();  // both CTAs' barriers exist before either CTA copies or arrives into the other

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      Walk w = walk_start(prm.s, cluster);
      Segment seg;
      while (next_segment(prm.s, w, seg)) {
        const TileCoord tc = tile_coord(prm, seg.u, rank);
        const CUtensorMap* ma = tc.e ? &ma1 : &ma0;
        const CUtensorMap* mw = tc.e ? &mw1 : &mw0;
        for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          unsigned char* sa = smem + stage * kStageBytes;
          unsigned char* sb = sa + kABytes;
          cuda::mbar_arrive_expect_tx(&full[stage], kStageBytes);
          const int k0 = kb * kBK;
          if constexpr (!TA) {
            tma_load(sa, ma, &full[stage], k0, tc.m0);
          } else {
            tma_load(sa, ma, &full[stage], tc.m0, k0);
            tma_load(sa + kBox, ma, &full[stage], tc.m0 + 64, k0);
          }
          // B is the same for both tiles of the pair: each CTA copies half of it into both
          if constexpr (TB) {
            tma_load_both(sb + rank * (kBBytes / 2), mw, &full[stage], k0, tc.n0 + 128 * int(rank));
          } else {
#pragma unroll
            for (int i = 2 * int(rank); i < 2 * int(rank) + 2; ++i)
              tma_load_both(sb + i * kBox, mw, &full[stage], tc.n0 + 64 * i, k0);
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {  // consumers: warpgroup c computes rows 64 c .. 64 c + 63 of each tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    int stage = 0;
    uint32_t phase = 0;
    // a stage is free again when the consumer warps of both CTAs are done with it (both copy into it)
    auto release = [&](int s) {
      for (int r = 0; r < kCluster; ++r) mbar_arrive_cluster(&empty[s], r);
    };
    const unsigned long long token = prm.s.slots ? launch_token() : 0;
    unsigned char* buf = out_buf + c * kOutBytes;  // kTmaOut: this warpgroup's staging buffer
    HeldHalf held;
    held.held = false;
    Walk w = walk_start(prm.s, cluster);
    Segment seg;
    while (next_segment(prm.s, w, seg)) {
      const TileCoord tc = tile_coord(prm, seg.u, rank);
      int prev = -1;
      for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb) {
        mbar_wait(&full[stage], phase);
        const uint32_t sa = cuda::smem_addr(smem + stage * kStageBytes) + c * (kABytes / 2);
        const uint32_t sb = cuda::smem_addr(smem + stage * kStageBytes + kABytes);
        fence_acc(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // K-major: rows of 128 bytes, 8-row groups 1024 bytes apart, k16 steps 32 bytes in. M/N-major:
          // 64-element atoms of 128-byte rows (one row a k), atoms kBox apart, k16 steps 2048 bytes.
          const uint64_t da = TA ? smem_desc(sa + kk * 2048, kBox, 1024) : smem_desc(sa + kk * 32, 16, 1024);
          const uint64_t db = TB ? smem_desc(sb + kk * 32, 16, 1024) : smem_desc(sb + kk * 2048, kBox, 1024);
          wgmma_n256<T, TA, TB>(d, da, db, (kb > seg.kb_begin || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        // the last block's second half, while this k-block's and the previous one's wgmma run
        if (kTmaOut && kb == seg.kb_begin + 1) store_held_half(held, buf, c);
        wgmma_wait<1>();  // the previous stage's wgmma are done: release it
        fence_acc(d);
        if (prev >= 0 && threadIdx.x % 32 == 0) release(prev);
        prev = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      wgmma_wait<0>();
      fence_acc(d);
      if (prev >= 0 && threadIdx.x % 32 == 0) release(prev);
      if (kTmaOut) store_held_half(held, buf, c);  // (a segment of one k-block)
      const Problem& p = prm.p[tc.e];
      const bool rows = tc.m0 + 64 * c < p.m;  // the warpgroup's block holds output rows
      if (seg.spill) {
        if (rows) spill_partial(d, prm, slot_part(seg.slot, rank, c), c, token);
        continue;
      }
      if (seg.gather && rows) gather_partials(d, prm, seg, rank, c, token);
      if constexpr (kTmaOut) {
        if (rows) store_block_tma<T>(d, buf, tc.e ? &mo1 : &mo0, p.n, tc.m0 + 64 * c, tc.n0, c, held);
      } else {
        store_tile<T>(d, p, tc.m0 + 64 * c, tc.n0);
      }
    }
    if (kTmaOut) {
      store_held_half(held, buf, c);
      if (threadIdx.x % 128 == 0) cuda::bulk_wait_all();  // the last stores complete before exit
    }
  }
  cluster_sync();  // neither CTA exits while the other may still arrive on its barriers
#endif  // MMFUSE_SM90A
}

// ---- host ------------------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    MMFUSE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    MMFUSE_CHECK(q == cudaDriverEntryPointSuccess && p, "dual_gemm: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A [rows, cols] row-major operand with row stride ld (elements) as a tensor map of box_cols x
// box_rows boxes (box_cols * 2 = 128 bytes: the swizzle span).
CUtensorMap operand_map(const TensorView& v, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(v.shape[1]), cuuint64_t(v.shape[0])};
  const cuuint64_t strides[1] = {cuuint64_t(std::max<int64_t>(v.stride[0], v.shape[1])) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)}, estr[2] = {1, 1};
  const CUtensorMapDataType type =
      v.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = tensor_map_encoder()(&map, type, 2, v.data, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MMFUSE_CHECK(r == CUDA_SUCCESS, "dual_gemm: cuTensorMapEncodeTiled failed (", int(r), ") for a ", shape_str(v),
               " operand");
  return map;
}

template <class T, bool TA, bool TB, bool kTmaOut>
void launch(const Sm90Expert (&ex)[2], bool accumulate, int mode, const TensorView& ws, cudaStream_t stream) {
  auto kernel = dual_gemm_sm90_kernel<T, TA, TB, kTmaOut>;
  constexpr int kSmem = kSmemBytes<kTmaOut>;
  const int dev = cuda::current_device();
  cuda::cached_fact(std::make_tuple(dev, reinterpret_cast<const void*>(kernel), 0), [&] {
    MMFUSE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    return 0;
  });
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const int max_clusters = cuda::cached_fact(std::make_tuple(dev, reinterpret_cast<const void*>(kernel), 1), [&] {
    int sms = 0, n = 0;
    MMFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaLaunchConfig_t q = cfg;
    q.gridDim = dim3(sms / kCluster * kCluster);
    MMFUSE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &q));
    MMFUSE_CHECK(n >= 1, "dual_gemm: no cluster of two CTAs of the persistent kernel fits on device ", dev);
    return n;
  });
  // schedule order: the costlier tiles (larger k) first, then the problem with more tiles
  Params prm{};
  CUtensorMap maps[2][3];  // a, w and out (kTmaOut) of each problem
  int unit_count[2], kblocks[2];
  int order[2] = {0, 1};
  auto units = [](const Sm90Expert& x) {
    return x.m == 0 || x.n == 0 ? int64_t(0) : ((x.m + kCluster * kBM - 1) / (kCluster * kBM)) * ((x.n + kBN - 1) / kBN);
  };
  if (std::make_pair(ex[1].k, units(ex[1])) > std::make_pair(ex[0].k, units(ex[0]))) std::swap(order[0], order[1]);
  for (int i = 0; i < 2; ++i) {
    const Sm90Expert& x = ex[order[i]];
    Problem& p = prm.p[i];
    p.m = int(x.m);
    p.n = int(x.n);
    p.pairs_m = int((x.m + kCluster * kBM - 1) / (kCluster * kBM));
    unit_count[i] = int(units(x));
    kblocks[i] = int((x.k + kBK - 1) / kBK);
    p.out = x.out->data;
    p.out_kind = x.out->dtype != DType::kFloat32 ? kOutInput : accumulate ? kOutFloatAccumulate : kOutFloat;
    if (unit_count[i] == 0) {  // no tiles: its maps are never read, but must be valid parameters
      std::memset(&maps[i], 0, sizeof(maps[i]));
      continue;
    }
    maps[i][0] = operand_map(*x.a, TA ? 64 : kBM);
    maps[i][1] = operand_map(*x.w, TB ? kBN / kCluster : 64);
    if (kTmaOut) maps[i][2] = operand_map(*x.out, 64);  // out [m, n]: boxes of 64 rows of 64
    else std::memset(&maps[i][2], 0, sizeof(maps[i][2]));
  }
  if (unit_count[0] + unit_count[1] == 0) return;
  const bool ws_ok = ws.defined() && reinterpret_cast<uintptr_t>(ws.data) % 256 == 0;
  prm.s = make_schedule(unit_count, kblocks, max_clusters, mode, ws_ok ? size_t(ws.shape[0]) * dtype_size(ws.dtype) : 0);
  if (prm.s.slots) {
    prm.flags = static_cast<unsigned long long*>(ws.data);
    prm.partial = reinterpret_cast<float*>(static_cast<unsigned char*>(ws.data) + schedule_flag_bytes(prm.s.slots));
  }
  cfg.gridDim = dim3(kCluster * prm.s.clusters);
  MMFUSE_CUDA_CHECK(
      cudaLaunchKernelEx(&cfg, kernel, maps[0][0], maps[0][1], maps[1][0], maps[1][1], maps[0][2], maps[1][2], prm));
}

// The TMA epilogue where every non-empty output is in the input dtype, contiguous with rows of a
// multiple of 16 bytes (n % 8 == 0) at a 16-byte-aligned address (TMA's rules); else the register
// epilogue. MMFUSE_DUAL_GEMM_EPILOGUE=registers forces the register epilogue (for tests and
// measurements). Persistent us, H100 2026-12-05 19:25, TMA (second half stored before the next
// tile) / registers: tiny-small fwd 74.4 / 92.0, dW 85.0 / 117.7; large fwd 522.5 / 597.0. The held
// second half against storing it before the next tile (21:28, the tiles schedule): 0-2 % faster on
// 11 of the 12 benchmark GEMMs (large fwd 510.4 / 513.7, VLA down dX 501.6 / 511.7), the twelfth
// within 0.2 %.
bool tma_epilogue(const Sm90Expert (&ex)[2]) {
  if (env_choice("dual_gemm", "MMFUSE_DUAL_GEMM_EPILOGUE", {"auto", "registers"}) == 1) return false;
  for (const Sm90Expert& x : ex) {
    if (x.m == 0 || x.n == 0) continue;
    const TensorView& o = *x.out;
    const bool ok = o.dtype == x.a->dtype && x.n % 8 == 0 && o.stride[1] == 1 && (x.m == 1 || o.stride[0] == x.n) &&
                    reinterpret_cast<uintptr_t>(o.data) % 16 == 0;
    if (!ok) return false;
  }
  return true;
}

}  // namespace

bool sm90_dual_gemm_supported(int device) {
  return cuda::cached_fact(std::make_tuple(device, static_cast<const void*>(nullptr), 2), [&] {
    int major = 0, minor = 0;
    MMFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MMFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major != 9 || minor != 0) return 0;
    cudaFuncAttributes attr{};  // the build must hold sm_90a code (else the kernel body is empty)
    MMFUSE_CUDA_CHECK(cudaFuncGetAttributes(&attr, dual_gemm_sm90_kernel<__nv_bfloat16, false, true, false>));
    return attr.binaryVersion == 90 ? 1 : 0;
  }) != 0;
}

void sm90_dual_gemm(const Sm90Expert (&ex)[2], const DualGemmOptions& o, const TensorView& ws, cudaStream_t stream) {
  const DType in = ex[0].a->dtype;
  const int layout = (o.trans_a ? 2 : 0) + (o.trans_b ? 1 : 0);
  const bool tma_out = tma_epilogue(ex);
  // MMFUSE_DUAL_GEMM_SCHEDULE: auto (make_schedule's rule), tiles or stream-k (for tests and
  // measurements; the ScheduleMode values in this order)
  const int mode = env_choice("dual_gemm", "MMFUSE_DUAL_GEMM_SCHEDULE", {"auto", "tiles", "stream-k"});
  auto go = [&](auto tag) {
    using T = decltype(tag);
    auto with = [&](auto tma) {
      constexpr bool kTma = decltype(tma)::value;
      switch (layout) {
        case 0: return launch<T, false, false, kTma>(ex, o.accumulate, mode, ws, stream);
        case 1: return launch<T, false, true, kTma>(ex, o.accumulate, mode, ws, stream);
        case 2: return launch<T, true, false, kTma>(ex, o.accumulate, mode, ws, stream);
        default: return launch<T, true, true, kTma>(ex, o.accumulate, mode, ws, stream);
      }
    };
    if (tma_out)
      with(std::true_type{});
    else
      with(std::false_type{});
  };
  if (in == DType::kBFloat16)
    go(__nv_bfloat16{});
  else
    go(__half{});
}

}  // namespace detail
}  // namespace mmfuse
