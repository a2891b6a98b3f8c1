// CUDA backend of fp8_gemm: cuBLASLt.
//
// fp8 "TN": out^T [N, M] (column-major, leading dimension N) = b^T [N, Kp] x
// a [Kp, M], with b as cuBLAS's A and a as its B; scales as device pointers (A scale = scale_b, B
// scale = scale_a; per row: cuBLASLt's outer-vector mode), optional bf16 bias epilogue, fast
// accumulation as asked. The heuristic's algorithm is cached per problem (bounded), descriptors live
// on the stack per call.
#include <cuda_runtime.h>

#include <tuple>

#include "common/cuda_check.h"
#include "cuda/cublaslt.h"
#include "backends/fp8.h"
#include "mmfuse/fp8.h"

namespace mmfuse {
namespace detail {
namespace {

struct GemmKey {
  int device;
  DType ta, tb, tout;
  int64_t m, n, k, ldo;
  bool bias, accumulate, fast, vec;
  uint32_t align_a, align_b, align_out;
  size_t ws;
  auto tie() const {
    return std::make_tuple(device, int(ta), int(tb), int(tout), m, n, k, ldo, bias, accumulate, fast, vec, align_a,
                           align_b, align_out, ws);
  }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

using cuda::cuda_type;

struct GemmDescs {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatrixLayoutOpaque_t al, bl, cl;
};

void describe(const GemmKey& key, const void* scale_a, const void* scale_b, const void* bias, GemmDescs& d) {
  MMFUSE_CUBLAS_CHECK(cublasLtMatmulDescInit(&d.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
    MMFUSE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d.desc, attr, v, size));
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn));
  // cuBLAS's A is our b, its B our a
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof(scale_b));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof(scale_a));
  if (key.vec) {  // per row: one scale per row of out^T's rows (b's) and of its columns (a's rows)
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode));
  }
  const int8_t fast = key.fast ? 1 : 0;
  set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
  if (key.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bt = CUDA_R_16BF;
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
  }
  MMFUSE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d.al, cuda_type(key.tb), key.k, key.n, key.k));
  MMFUSE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d.bl, cuda_type(key.ta), key.k, key.m, key.k));
  MMFUSE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d.cl, cuda_type(key.tout), key.n, key.m, key.ldo));
}


}  // namespace

void fp8_gemm_cuda(const TensorView& a, const TensorView& b, const TensorView& scale_a, const TensorView& scale_b,
                   const TensorView& bias, TensorView& out, const Fp8GemmOptions& o, TensorView& ws,
                   cudaStream_t stream) {
  const int64_t m = a.shape[0], n = b.shape[0], k = a.shape[1];
  if (m == 0 || n == 0) return;
  const int64_t ldo = n;  // out is contiguous (checked)
  if (k == 0) {  // an empty sum: zero, or the accumulator unchanged (a bias is rejected before)
    if (!o.accumulate) MMFUSE_CUDA_CHECK(cudaMemsetAsync(out.data, 0, size_t(m * n) * dtype_size(out.dtype), stream));
    return;
  }
  MMFUSE_CHECK(cuda::alignment(a.data) >= 16 && cuda::alignment(b.data) >= 16 && cuda::alignment(out.data) >= 16,
               "fp8_gemm: a, b and out must be 16-byte aligned");
  GemmKey key{};
  key.device = out.device.index;
  key.ta = a.dtype;
  key.tb = b.dtype;
  key.tout = out.dtype;
  key.m = m;
  key.n = n;
  key.k = k;
  key.ldo = ldo;
  key.bias = bias.defined();
  key.accumulate = o.accumulate;
  key.fast = o.fast_accum;
  key.vec = scale_a.numel() != 1;
  key.align_a = cuda::alignment(a.data);
  key.align_b = cuda::alignment(b.data);
  key.align_out = cuda::alignment(out.data);
  key.ws = size_t(ws.shape[0]) * dtype_size(ws.dtype);
  GemmDescs d;
  describe(key, scale_a.data, scale_b.data, bias.defined() ? bias.data : nullptr, d);
  const cublasLtHandle_t h = cuda::cublaslt_handle(key.device);
  const cublasLtMatmulAlgo_t algo = cuda::AlgoCache<GemmKey>::get().find(key, [&] {
    cublasLtMatmulAlgo_t chosen;
    int st = 0;
    const bool ok = cuda::cublaslt_first_algo(h, &d.desc, &d.al, &d.bl, &d.cl, &d.cl, key.ws,
                                              {key.align_b, key.align_a, key.align_out, key.align_out}, &chosen, &st);
    MMFUSE_CHECK(ok, "fp8_gemm: cuBLASLt has no algorithm for ", m, "x", n, "x", k, " (", dtype_name(a.dtype), " x ",
                 dtype_name(b.dtype), " -> ", dtype_name(out.dtype), ", status ", st, ")");
    return chosen;
  });
  const float alpha = 1.0f, beta = o.accumulate ? 1.0f : 0.0f;
  MMFUSE_CUBLAS_CHECK(cublasLtMatmul(h, &d.desc, &alpha, b.data, &d.al, a.data, &d.bl, &beta, out.data, &d.cl,
                                     out.data, &d.cl, &algo, ws.data, key.ws, stream));
}

}  // namespace detail
}  // namespace mmfuse
