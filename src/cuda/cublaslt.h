// cuBLASLt pieces shared by the GEMM backends (dual_gemm, fp8): checked calls, one handle per device
// for the process, the heuristic's first algorithm for a described problem, and a
// bounded per-process cache of those algorithms.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>

#include "common/cuda_check.h"
#include "cuda/device_util.cuh"
#include "mmfuse/common.h"

#define MMFUSE_CUBLAS_CHECK(expr)                                                                      \
  do {                                                                                                 \
    cublasStatus_t mmfuse_st_ = (expr);                                                                \
    MMFUSE_CHECK(mmfuse_st_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt error in ", #expr, ": status ",      \
                 int(mmfuse_st_));                                                                     \
  } while (0)

namespace mmfuse {
namespace cuda {

// The cuBLAS data type of a tensor dtype (float64 and the integer types are rejected before).
inline cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kFloat8E4M3: return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2: return CUDA_R_8F_E5M2;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}


// The process's cuBLASLt handle for a device (created on first use, never destroyed).
inline cublasLtHandle_t cublaslt_handle(int device) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t>* handles = new std::map<int, cublasLtHandle_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles->find(device);
  if (it != handles->end()) return it->second;
  cublasLtHandle_t h = nullptr;
  MMFUSE_CUBLAS_CHECK(cublasLtCreate(&h));
  (*handles)[device] = h;
  return h;
}

// Minimum alignments (bytes) of A, B, C and D that the algorithm may assume.
struct Alignments {
  uint32_t a, b, c, d;
};

// The heuristic's best algorithm for D = op(A) op(B) (+ C) as described; fails with `what` (which
// names the op and the problem) when cuBLASLt has none.
inline bool cublaslt_first_algo(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t al,
                                cublasLtMatrixLayout_t bl, cublasLtMatrixLayout_t cl, cublasLtMatrixLayout_t dl,
                                uint64_t ws_bytes, const Alignments& align, cublasLtMatmulAlgo_t* algo,
                                int* status) {
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                              sizeof(ws_bytes));
  for (const auto& [attr, v] :
       {std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t>{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.d}})
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(h, desc, al, bl, cl, dl, pref, 1, &result, &found);
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  *status = int(st);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) return false;
  *algo = result.algo;
  return true;
}

// The heuristic's algorithm per problem (a plain value: descriptors are rebuilt per call), for the
// process, thread-safe; past kMax problems (token counts that keep changing) it starts over, so it
// stays bounded. choose() runs under the lock, once per problem not yet cached.
template <class Key>
class AlgoCache {
 public:
  static AlgoCache& get() {
    static AlgoCache* c = new AlgoCache();  // never destroyed: no teardown order issues at exit
    return *c;
  }
  template <class Choose>
  cublasLtMatmulAlgo_t find(const Key& key, Choose&& choose) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      if (plans_.size() >= kMax) plans_.clear();
      it = plans_.emplace(key, choose()).first;
    }
    return it->second;
  }

 private:
  static constexpr size_t kMax = 4096;
  std::mutex mu_;
  std::map<Key, cublasLtMatmulAlgo_t> plans_;
};

}  // namespace cuda
}  // namespace mmfuse
