// The rope family's backend entry points, called by src/rope.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include "mmfuse/rope.h"

namespace mmfuse {
namespace detail {
// Backends, called by mrope after validation. The views are already normalised: q/k/outs 4-D
// [B, L, H, D]; cos/sin 4-D [A, B, L, D]; positions 3-D [A, B, L]; freqs 3-D [B, L, D/2].
void mrope_cpu(const TensorView& q, const TensorView& k, const RopeAngles& a, const RopeParams& p,
               TensorView& q_out, TensorView& k_out);
#ifdef MMFUSE_WITH_CUDA
void mrope_cuda(const TensorView& q, const TensorView& k, const RopeAngles& a,
                const RopeParams& p, TensorView& q_out, TensorView& k_out, cudaStream_t stream);
#endif
}  // namespace detail

}  // namespace mmfuse
