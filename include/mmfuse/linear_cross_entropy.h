// The softmax cross-entropy of one chunk of fp32 logits and the gradient of its weighted loss, in two
// passes over the chunk: the fused step of mmfuse.linear_cross_entropy between its GEMMs (the logits
// of a chunk of tokens in, the gradient that the two gradient GEMMs read out); CPU and CUDA backends.
//
// z [C, V] fp32, or bf16 / fp16 with g of the same dtype (rows any stride, the last dim contiguous),
// labels [C] int64, row_scale [C] fp32. Per row, with zc = softcap > 0 ? softcap * tanh(z / softcap) : z
// and y = labels[row]:
//   lse     = log(sum_j exp(zc_j))
//   loss    = (1 - eps) (lse - zc_y) + eps (lse - mean_j zc_j) + z_loss lse^2
//   g_j     = row_scale * (exp(zc_j - lse) (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == y])
//             * (softcap > 0 ? 1 - (zc_j / softcap)^2 : 1)
// (eps = label_smoothing), fp32 math; loss and g are 0 in a row whose label is ignore_index. loss [C]
// fp32; g [C, V] bf16, fp16 or fp32, rounded once, or absent (the loss only). A label outside [0, V)
// that is not ignore_index is an error (CPU: an exception; CUDA: a device-side assertion with the
// message). Non-finite logits follow IEEE arithmetic (a NaN makes its row's loss and gradient NaN).
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

// g must not overlap z, labels, row_scale or loss.
MMFUSE_API void linear_cross_entropy_logits_grad(const TensorView& z, const TensorView& labels,
                                                 const TensorView& row_scale, int64_t ignore_index,
                                                 float label_smoothing, float z_loss, float softcap, TensorView& loss,
                                                 TensorView& g, cudaStream_t stream);

}  // namespace mmfuse
