// Device and host pieces shared by the MoE routing's CUDA kernels (src/cuda/moe/*.cu): index
// helpers, row vectors, bad-entry reporting, programmatic dependent launches and the warp walk.
// Included by each operation's .cu; everything is internal to that translation unit.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "cuda/device_util.cuh"
#include "cuda/moe/path.h"
#include "cuda/numerics.cuh"
#include "backends/moe.h"
#include "mmfuse/moe.h"

namespace mmfuse {
namespace detail {
namespace {

using cuda::compute_type;
using cuda::device_type;
using cuda::IndexRef;
using cuda::Vec;

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
inline MapRef map_ref(const TensorView& m) { return {static_cast<const int32_t*>(m.data), m.stride[0], m.stride[1]}; }
using namespace moe;  // the path rule's constants

// Programmatic dependent launches (PDL, sm_90+): a kernel launched with the attribute may start while
// the one before it drains; it calls pdl_wait_primary() before it reads what that one wrote, and
// pdl_launch_dependents() lets the next one start early. Without PDL both are no-ops.
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

using cuda::dispatch_vec;
using cuda::vec_bytes;

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

constexpr int kFlatThreads = 256, kPermUnroll = 4;

// Blocks for a flattened kernel over `work` items, `per_thread` each: enough to fill the GPU, then loop
// (`all`: enough for every item, up to 2^30 blocks, so that the hardware hands out the work).
inline unsigned flat_blocks(int64_t work, int per_thread, bool all = false) {
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

// Blocks of a warp-walk kernel over n items: enough for every item, at most those resident at once
// (each warp then walks items, the next one's map entries in flight with this one's rows; `all`: a
// warp for every item, up to 2^30 blocks, so that the hardware hands out the work).
inline unsigned row_blocks(const void* kernel, int64_t n, bool all = false) {
  const int64_t cap = all ? int64_t(1) << 30 : int64_t(cuda::resident_blocks(kernel, kRowThreads, 0));
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kRowWarps - 1) / kRowWarps, cap)));
}

inline void set_smem(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    MMFUSE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// Calls f(TypeTag<D>, VEC) with the widest vector that the rows allow (float64 included).
template <class F>
void dispatch_rows(DType dt, const char* what, int64_t H, std::initializer_list<std::pair<const void*, int64_t>> rows,
                   F&& f) {
  cuda::dispatch_row_vectors<true>(what, dt, H, rows, f);
}

}  // namespace
}  // namespace detail
}  // namespace mmfuse
