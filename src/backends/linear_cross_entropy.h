// The linear_cross_entropy family's backend entry points, called by src/linear_cross_entropy.cpp after
// validation (internal: not part of the public headers).
#pragma once

#include "mmfuse/linear_cross_entropy.h"

namespace mmfuse {
namespace detail {

struct LceParams {
  int64_t ignore_index;
  float label_smoothing, z_loss, softcap;
};

void linear_cross_entropy_logits_grad_cpu(const TensorView& z, const TensorView& labels, const TensorView& row_scale,
                                          const LceParams& p, TensorView& loss, TensorView& g);
#ifdef MMFUSE_WITH_CUDA
void linear_cross_entropy_logits_grad_cuda(const TensorView& z, const TensorView& labels,
                                           const TensorView& row_scale, const LceParams& p, TensorView& loss,
                                           TensorView& g, cudaStream_t stream);
#endif

}  // namespace detail
}  // namespace mmfuse
