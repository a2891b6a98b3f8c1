// The swiglu family's backend entry points, called by src/swiglu.cpp after validation (internal: not
// part of the public headers).
#pragma once

#include <cmath>

#include "common/numerics.h"
#include "mmfuse/swiglu.h"

namespace mmfuse {
namespace detail {

// One SwiGLU value on the CPU, rounded once to S: silu(g) * u as (g * sigmoid(g)) * u in S's compute
// type. Shared by the swiglu kernels and fp8_quantize's swiglu source, so both give the same bits.
template <class S>
inline S swiglu_value_cpu(S gate, S up) {
  using C = typename compute_type<S>::type;
  const C g = load_val(gate), u = load_val(up);
  const C sig = C(1) / (C(1) + std::exp(-g));
  return store_val<S>(g * sig * u);
}

// One element of the SwiGLU backward in C (the formulas of include/mmfuse/swiglu.h): d_gate, d_up and y.
// Shared by swiglu_backward(_fp8) and fp8_quantize's swiglu_grad source, so both give the same bits.
template <class C>
inline void swiglu_grad_value_cpu(C g, C u, C dv, C& dg, C& du, C& y) {
  const C sig = C(1) / (C(1) + std::exp(-g)), s = g * sig;
  dg = dv * u * (sig * (C(1) + g * (C(1) - sig)));
  du = dv * s;
  y = s * u;
}

// An element of swiglu_pack_fp8's pack: its e4m3 code times its tile's power-of-two scale (exact).
inline float swiglu_unpack_cpu(uint8_t code, float scale_inv) { return fp8_to_float(code, true) * scale_inv; }

#if defined(__CUDACC__)
#define MMFUSE_SWIGLU_HD __host__ __device__
#else
#define MMFUSE_SWIGLU_HD
#endif

// The power of two of swiglu_pack_fp8's tile scale from the amax's IEEE bits (finite, >= 0): the largest
// k in [-126, 126] with amax * 2^k <= 448 (0 for amax 0). Bits, not frexp: one definition for the CPU and
// the device.
MMFUSE_SWIGLU_HD inline int swiglu_pack_exponent(uint32_t amax_bits) {
  const int e = int(amax_bits >> 23) & 0xff;
  const uint32_t m = amax_bits & 0x7fffffu;
  if (e == 0) return m ? 126 : 0;  // a subnormal amax takes the clamp
  // amax = (1 + m / 2^23) 2^(e - 127) and 448 = 1.75 * 2^8: one power of two less where the mantissa
  // is above 1.75
  const int k = (m <= 0x600000u ? 9 : 8) - (e - 126);
  return k < -126 ? -126 : (k > 126 ? 126 : k);
}

void swiglu_cpu(const TensorView& gate_up, TensorView& out);
void swiglu_backward_cpu(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y);
void swiglu_pack_fp8_cpu(const TensorView& gate_up, TensorView& q, TensorView& scale_inv);
void swiglu_backward_fp8_cpu(const TensorView& dy, const TensorView& q, const TensorView& scale_inv,
                             TensorView& d_gate_up, TensorView& y);
#ifdef MMFUSE_WITH_CUDA
void swiglu_cuda(const TensorView& gate_up, TensorView& out, cudaStream_t stream);
void swiglu_backward_cuda(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y,
                          cudaStream_t stream);
void swiglu_pack_fp8_cuda(const TensorView& gate_up, TensorView& q, TensorView& scale_inv, cudaStream_t stream);
void swiglu_backward_fp8_cuda(const TensorView& dy, const TensorView& q, const TensorView& scale_inv,
                              TensorView& d_gate_up, TensorView& y, cudaStream_t stream);
#endif

}  // namespace detail
}  // namespace mmfuse
