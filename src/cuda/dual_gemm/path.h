// Path choice of the dual-expert GEMM's CUDA backend: a pure host function, unit-tested on the CPU.
#pragma once

#include <cstdint>

namespace mmfuse {
namespace detail {
namespace dual_gemm {

// Whether expert 1's product runs first: the bigger product first, so that the small one's kernels
// start as the big one's last wave drains.
inline bool second_first(int64_t m0, int64_t n0, int64_t k0, int64_t m1, int64_t n1, int64_t k1) {
  return double(m0) * double(n0) * double(k0) < double(m1) * double(n1) * double(k1);
}

}  // namespace dual_gemm
}  // namespace detail
}  // namespace mmfuse
