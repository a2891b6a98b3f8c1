// The rms_norm family's backend entry points, called by src/rms_norm.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/rms_norm.h"

namespace mmfuse {
namespace detail {

// The row of a grouped tensor that holds token t (RmsNormGrouping): t itself where not grouped.
struct RowGroups {
  int64_t L = 0, S = 0, B = 0;  // L = 0: identity
  int64_t row(int64_t t, bool grouped) const {
    if (!grouped || L == 0) return t;
    const int64_t b = t / L, l = t - b * L;
    return l < S ? b * S + l : B * S + b * (L - S) + (l - S);
  }
};

void rms_norm_cpu(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
                  const RmsNormGrouping& g, TensorView& out, TensorView& h_out, TensorView& rstd);
void rms_norm_backward_cpu(const TensorView& dout, const TensorView& dh, const TensorView& h, const TensorView& rstd,
                           const TensorView& weight, const RmsNormGrouping& g, TensorView& dx, TensorView& dres,
                           TensorView& dweight);
#ifdef MMFUSE_WITH_CUDA
void rms_norm_cuda(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
                   const RmsNormGrouping& g, TensorView& out, TensorView& h_out, TensorView& rstd,
                   cudaStream_t stream);
void rms_norm_backward_cuda(const TensorView& dout, const TensorView& dh, const TensorView& h, const TensorView& rstd,
                            const TensorView& weight, const RmsNormGrouping& g, TensorView& dx, TensorView& dres,
                            TensorView& dweight, TensorView& workspace, cudaStream_t stream);
#endif

}  // namespace detail
}  // namespace mmfuse
