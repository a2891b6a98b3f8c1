// SwiGLU on the fused gate/up layout of a gated MLP: y = silu(gate) * up, and its backward, with the
// activation recomputed there instead of stored; CPU and CUDA backends.
//
// gate_up [T, 2I] holds each token's gate in columns [0, I) and its up in [I, 2I) (the output of one
// GEMM against the stacked [gate; up] weight). bf16, fp16, fp32 or fp64 (CPU only); the last dim
// contiguous, rows any stride. Computed in fp32 (fp64 for fp64), rounded once:
//   y[t, j] = round(s * u),  s = g * sigmoid(g),  g = gate_up[t, j],  u = gate_up[t, I + j]
// Backward, given dy [T, I]:
//   d_gate_up[t, j]     = round(dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))))
//   d_gate_up[t, I + j] = round(dy * s)
// and, optionally, y recomputed (the down projection's weight gradient needs it): the forward's bits.
// Non-finite inputs follow IEEE arithmetic, as F.silu(gate) * up does (silu(-inf) is NaN).
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

MMFUSE_API void swiglu(const TensorView& gate_up, TensorView& out, cudaStream_t stream);

// dy, gate_up -> d_gate_up [T, 2I], and y [T, I] where given (absent: not written). In place is
// allowed as exact pairs only: d_gate_up may be gate_up itself and y may be dy itself (each element
// is read before its thread writes it), which frees the caller of two activation-sized buffers;
// any other overlap, and an expanded output, is an error.
MMFUSE_API void swiglu_backward(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y,
                                cudaStream_t stream);

}  // namespace mmfuse
