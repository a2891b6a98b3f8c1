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

// The SwiGLU input kept for the backward in one byte an element (an fp8 layer's saved activation):
// gate_up [T, 2I] (bf16, fp16 or fp32) -> q [T, 2I] e4m3 and scale_inv [T, ceil(2I / 128)] float32. Each
// row's 128-column tile c is scaled by 2^k, k the largest integer in [-126, 126] with amax * 2^k <= 448
// (amax over the tile's finite values; k = 0 for a tile without one): q = e4m3(x * 2^k), rounded to
// nearest even (Inf and NaN to NaN, the fp8 rule of SEMANTICS.md), scale_inv[t, c] = 2^-k. Power-of-two
// scales keep the product exact: the only rounding is the e4m3 one (relative error <= 2^-4 for the
// tile's values above amax / 2^14, absolute <= amax / 2^17 below). Tiles, not one scale a tensor: no
// amax pass first, and an outlier costs only its own 128 values their precision.
constexpr int64_t kSwigluPackTile = 128;
// scale_inv's columns for a gate_up of `cols` columns.
constexpr int64_t swiglu_pack_tiles(int64_t cols) { return (cols + kSwigluPackTile - 1) / kSwigluPackTile; }
MMFUSE_API void swiglu_pack_fp8(const TensorView& gate_up, TensorView& q, TensorView& scale_inv, cudaStream_t stream);

// swiglu_backward from the packed input: gate_up = q * scale_inv (exact), then the formulas above in
// dy's type (bf16, fp16 or fp32; d_gate_up and y of that type). y may be dy itself (in place); any
// other overlap, and an expanded output, is an error.
MMFUSE_API void swiglu_backward_fp8(const TensorView& dy, const TensorView& q, const TensorView& scale_inv,
                                    TensorView& d_gate_up, TensorView& y, cudaStream_t stream);

}  // namespace mmfuse
