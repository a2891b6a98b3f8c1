// CUDA backend of the dual-expert GEMM: cuBLASLt, one cublasLtMatmul an expert on the caller's
// stream, the bigger product first. The heuristic's algorithm is chosen once per problem (shape, layout, dtypes,
// pointer alignment, accumulate) and cached (bounded); the descriptors and layouts are initialised
// in stack storage per call. A call after the first does no device query, no host-to-device copy and
// no allocation (the workspace is the caller's).
//
// Row-major to column-major: out[m, n] = op(a) @ op(w) is, in cuBLAS's column-major terms,
// out^T[n, m] = op(w)^T @ op(a)^T, where a row-major [r, c] buffer with row stride ld reads as a
// column-major [c, r] matrix with leading dimension ld.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstring>
#include <tuple>

#include "common/cuda_check.h"
#include "cuda/cublaslt.h"
#include "cuda/dual_gemm/path.h"
#include "backends/dual_gemm.h"
#include "mmfuse/dual_gemm.h"

namespace mmfuse {
namespace detail {
namespace {

using cuda::alignment;
using cuda::cuda_type;

struct Key {
  int device;
  DType in, out;
  bool ta, tb, accumulate;
  int64_t m, n, k, lda, ldw;
  uint32_t align_a, align_w, align_out;
  size_t ws;
  bool operator<(const Key& o) const {
    auto tie = [](const Key& x) {
      return std::make_tuple(x.device, int(x.in), int(x.out), x.ta, x.tb, x.accumulate, x.m, x.n, x.k, x.lda, x.ldw,
                             x.align_a, x.align_w, x.align_out, x.ws);
    };
    return tie(*this) < tie(o);
  }
};

// The descriptors of one problem, in caller (stack) storage: built per call, a few host stores, no
// allocation.
struct Descs {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatrixLayoutOpaque_t wl, al, cl;
};

void describe(const Key& key, Descs& d) {
  const cudaDataType_t in = cuda_type(key.in), out = cuda_type(key.out);
  MMFUSE_CUBLAS_CHECK(cublasLtMatmulDescInit(&d.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // column-major operands: A = w (op: N if w is [k, n], T if [n, k]), B = a (N if [m, k], T if [k, m])
  const cublasOperation_t opw = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  MMFUSE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opw, sizeof(opw)));
  MMFUSE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opa, sizeof(opa)));
  // stored (column-major) shapes: w is [n, k] (N) or [k, n] (T); a is [k, m] (N) or [m, k] (T)
  MMFUSE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d.wl, in, key.tb ? key.k : key.n, key.tb ? key.n : key.k, key.ldw));
  MMFUSE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d.al, in, key.ta ? key.m : key.k, key.ta ? key.k : key.m, key.lda));
  MMFUSE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d.cl, out, key.n, key.m, key.n));
}

// The heuristic's algorithm for a problem (the only thing cached: a plain value).
cublasLtMatmulAlgo_t choose_algo(cublasLtHandle_t h, const Key& key, Descs& d) {
  cublasLtMatmulAlgo_t algo;
  int st = 0;
  const bool ok = cuda::cublaslt_first_algo(h, &d.desc, &d.wl, &d.al, &d.cl, &d.cl, key.ws,
                                            {key.align_w, key.align_a, key.align_out, key.align_out}, &algo, &st);
  MMFUSE_CHECK(ok, "dual_gemm: cuBLASLt has no algorithm for ", key.m, "x", key.n, "x", key.k, " (status ", st, ")");
  return algo;
}

// One expert: out (+)= op(a) @ op(w).
void gemm_one(const TensorView& a, const TensorView& w, TensorView& out, const DualGemmOptions& o, void* ws,
              size_t ws_bytes, cudaStream_t stream) {
  const int64_t m = out.shape[0], n = out.shape[1], k = o.trans_a ? a.shape[0] : a.shape[1];
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: zero, or the accumulator unchanged
    if (!o.accumulate) MMFUSE_CUDA_CHECK(cudaMemsetAsync(out.data, 0, size_t(m * n) * dtype_size(out.dtype), stream));
    return;
  }
  Key key{};
  key.device = out.device.index;
  key.in = a.dtype;
  key.out = out.dtype;
  key.ta = o.trans_a;
  key.tb = o.trans_b;
  key.accumulate = o.accumulate;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = std::max<int64_t>(a.stride[0], std::max<int64_t>(1, a.shape[1]));
  key.ldw = std::max<int64_t>(w.stride[0], std::max<int64_t>(1, w.shape[1]));
  key.align_a = alignment(a.data);
  key.align_w = alignment(w.data);
  key.align_out = alignment(out.data);
  key.ws = ws_bytes;
  Descs d;
  describe(key, d);
  const cublasLtHandle_t h = cuda::cublaslt_handle(key.device);
  const cublasLtMatmulAlgo_t algo = cuda::AlgoCache<Key>::get().find(key, [&] { return choose_algo(h, key, d); });
  const float alpha = 1.0f, beta = o.accumulate ? 1.0f : 0.0f;
  MMFUSE_CUBLAS_CHECK(cublasLtMatmul(h, &d.desc, &alpha, w.data, &d.wl, a.data, &d.al, &beta, out.data, &d.cl,
                                     out.data, &d.cl, &algo, ws, ws_bytes, stream));
}

}  // namespace

void dual_gemm_cuda(const TensorView& a0, const TensorView& w0, TensorView& out0, const TensorView& a1,
                    const TensorView& w1, TensorView& out1, const DualGemmOptions& o, TensorView& ws,
                    cudaStream_t stream) {
  const size_t ws_bytes = size_t(ws.shape[0]) * dtype_size(ws.dtype);
  // the bigger product first: the small one's kernels start as the big one's last wave drains
  if (!dual_gemm::second_first(out0.shape[0], out0.shape[1], o.trans_a ? a0.shape[0] : a0.shape[1], out1.shape[0],
                    out1.shape[1], o.trans_a ? a1.shape[0] : a1.shape[1])) {
    gemm_one(a0, w0, out0, o, ws.data, ws_bytes, stream);
    gemm_one(a1, w1, out1, o, ws.data, ws_bytes, stream);
  } else {
    gemm_one(a1, w1, out1, o, ws.data, ws_bytes, stream);
    gemm_one(a0, w0, out0, o, ws.data, ws_bytes, stream);
  }
}

}  // namespace detail
}  // namespace mmfuse
