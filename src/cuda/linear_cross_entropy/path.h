// Launch shape of linear_cross_entropy's logits-gradient kernels: a pure host function, unit-tested on
// the CPU.
#pragma once

#include <cstdint>

namespace mmfuse {
namespace detail {
namespace lce {

constexpr int kThreads = 512;
// A block's slice of a row in shared memory: at most this, so that two blocks share an SM and one's
// loads overlap the other's stores.
constexpr int64_t kMaxSliceBytes = 96 * 1024;
constexpr int kMaxCluster = 8;  // the portable cluster size
// The two-pass kernel's second read comes from L2 only while its rows in flight (a few hundred) fit
// there: from rows of this size on, the one-read kernel saves a read from memory.
constexpr int64_t kMinClusterRowBytes = 64 * 1024;

// Debug override (MMFUSE_LCE_GRAD): 0 auto, 1 the two-pass kernel, 2 the one-read (cluster) kernel.
enum class GradForce { kAuto = 0, kTwoPass = 1, kCluster = 2 };

// The one-read kernel is chosen only on request until it has been measured against the two-pass one.
constexpr bool kClusterAuto = false;

struct GradLaunch {
  int cluster;    // blocks a row (a thread-block cluster sharing its statistics); 0: the two-pass kernel
  int64_t slice;  // logits a block holds in shared memory (a multiple of a 16-byte vector)
};

// The row of V logits of z_bytes each, split over the fewest blocks (1, 2, 4 or 8) whose slices fit
// kMaxSliceBytes. `aligned`: z's data, row stride and V * z_bytes multiples of 16 bytes and g's of its
// vector (the bulk copies and vector stores of the one-read kernel); arch: the kernel's (90: sm_90).
inline GradLaunch grad_launch(int64_t V, int z_bytes, bool aligned, int arch, GradForce force) {
  if (force == GradForce::kTwoPass || !aligned || arch < 90 || V <= 0 || z_bytes <= 0 || 16 % z_bytes) return {0, 0};
  if (force == GradForce::kAuto && (!kClusterAuto || V * z_bytes < kMinClusterRowBytes)) return {0, 0};
  const int64_t vec = 16 / z_bytes;
  for (int cs = 1; cs <= kMaxCluster; cs *= 2) {
    const int64_t slice = ((V + cs - 1) / cs + vec - 1) / vec * vec;
    if (slice * z_bytes <= kMaxSliceBytes) return {cs, slice};
  }
  return {0, 0};  // a row past 8 slices: the two-pass kernel
}

}  // namespace lce
}  // namespace detail
}  // namespace mmfuse
