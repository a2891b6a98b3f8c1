// Checked CUDA runtime calls for the core: every call and every launch goes through these.
#pragma once

#include <cuda_runtime_api.h>

#include "mmfuse/common.h"

#define MMFUSE_CUDA_CHECK(expr)                                                                    \
  do {                                                                                             \
    cudaError_t mmfuse_err_ = (expr);                                                              \
    MMFUSE_CHECK(mmfuse_err_ == cudaSuccess, "CUDA error in ", #expr, ": ", cudaGetErrorName(mmfuse_err_), \
                 ": ", cudaGetErrorString(mmfuse_err_));                                           \
  } while (0)

// After a <<<...>>> launch: reports bad launch configurations at once (never synchronizes).
#define MMFUSE_CUDA_CHECK_LAUNCH(name)                                                             \
  do {                                                                                             \
    cudaError_t mmfuse_err_ = cudaGetLastError();                                                  \
    MMFUSE_CHECK(mmfuse_err_ == cudaSuccess, "CUDA launch of ", name, " failed: ",                 \
                 cudaGetErrorName(mmfuse_err_), ": ", cudaGetErrorString(mmfuse_err_));            \
  } while (0)
