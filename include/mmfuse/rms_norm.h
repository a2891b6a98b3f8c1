// Residual add + RMSNorm, the transformer layer's norm (HF Qwen2 / Qwen2.5-VL numerics), with an
// optional grouping of the rows by token type fused in; CPU and CUDA backends.
//
// Forward, for each token t of T = rows(x) (all views [T, H], last dim contiguous, one dtype: bf16,
// fp16, fp32 or fp64; weight [H] of that dtype):
//   h[t]     = x[gx(t)] + residual[t]           rounded to the dtype (HF adds in the dtype); h[t] =
//                                               x[gx(t)] without a residual (h_out is written where
//                                               there is a residual or x is grouped)
//   rstd[t]  = 1 / sqrt(mean_j h[t, j]^2 + eps)   fp32 (fp64 for fp64), stored [T]
//   out[go(t)] = round(weight * round(h[t] * rstd[t]))   HF's `weight * hidden.to(dtype)`
// The grouping: with grouping.seq_len = L > 0, tokens are B = T / L samples of L, the first
// grouping.split of each sample of group 0, the rest of group 1, and a grouped tensor holds all
// samples' group-0 rows first (sample by sample), then all group-1 rows:
//   g(t) = l < S ? b * S + l : B * S + b * (L - S) + (l - S),   b = t / L, l = t % L, S = split.
// gx is g where x_grouped, else the identity; go likewise with out_grouped. A VLA layer's experts
// then read their tokens as two contiguous blocks, and write them back there, with no copy.
//
// Non-finite inputs give what HF's formula gives: an Inf in a row makes its mean square Inf, so the
// row's finite entries normalize to 0 and the Inf to NaN; a NaN makes the row NaN; other rows are
// untouched.
//
// Backward, given dout (in out's order) and optionally dh (the gradient of h from the residual
// stream, natural order):
//   gw = dout[go(t)] * weight,  xhat = h * rstd,
//   dh_total[t] = rstd * (gw - xhat * mean_j(gw * xhat)) + dh[t]   (fp32, rounded once)
//   dx[gx(t)] = dh_total[t];  dresidual[t] = dh_total[t] (written only where x is grouped: else it
//   is dx itself);  dweight = sum_t dout[go(t)] * round(xhat[t])   (fp32, a fixed summation order:
//   the same bits on every run).
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

struct RmsNormGrouping {
  int64_t seq_len = 0;  // L; 0: no grouping
  int64_t split = 0;    // S, the group-0 tokens of each sample, 0 <= S <= L
  bool x_grouped = false;
  bool out_grouped = false;
};

// x, residual (optional), weight -> out, h_out (written where residual is given or x is grouped),
// rstd (float32 [T]; float64 for float64 inputs). Outputs must not overlap the inputs.
MMFUSE_API void rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
                         const RmsNormGrouping& grouping, TensorView& out, TensorView& h_out, TensorView& rstd,
                         cudaStream_t stream);

// float32 elements of the backward's CUDA workspace (the weight gradient's per-block partial sums);
// the CPU backend needs none.
MMFUSE_API int64_t rms_norm_backward_workspace_size(int64_t tokens, int64_t hidden);

// dout, dh (optional), h (the forward's h_out, or x where it wrote none: natural order), rstd,
// weight -> dx (x's order), dresidual (natural order; needed only where x is grouped, else absent),
// dweight (float32 [H]; float64 for float64). workspace: float32, the size above (CUDA).
MMFUSE_API void rms_norm_backward(const TensorView& dout, const TensorView& dh, const TensorView& h,
                                  const TensorView& rstd, const TensorView& weight, const RmsNormGrouping& grouping,
                                  TensorView& dx, TensorView& dresidual, TensorView& dweight, TensorView& workspace,
                                  cudaStream_t stream);

}  // namespace mmfuse
