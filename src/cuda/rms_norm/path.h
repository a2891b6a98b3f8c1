// Launch shape of the rms_norm CUDA kernels: a pure host function, unit-tested on the CPU.
#pragma once

#include <algorithm>
#include <cstdint>

namespace mmfuse {
namespace detail {
namespace rms_norm {

constexpr int kMaxThreads = 1024;
constexpr int kMaxVectorsPerThread = 8;
// Threads a row's block aims at: enough loads in flight a block, few enough that small rows fill them.
constexpr int kTargetThreads = 256;

struct RowShape {
  int vectors_per_thread;  // 1, 2, 4 or 8; 0: the row does not fit a block in registers (streaming kernel)
  int threads;             // a multiple of 32
};

// A block a row, each thread holding `vectors_per_thread` vectors of it in registers: the fewest
// vectors a thread that keep the block at kTargetThreads or less (more threads a row only where a
// row needs more than kMaxVectorsPerThread vectors a thread at that size).
inline RowShape row_shape(int64_t vectors) {
  for (int nv = 1; nv <= kMaxVectorsPerThread; nv *= 2) {
    const int64_t threads = (vectors + nv - 1) / nv;
    if (threads <= kTargetThreads || (nv == kMaxVectorsPerThread && threads <= kMaxThreads))
      return {nv, int(std::max<int64_t>(32, (threads + 31) / 32 * 32))};
  }
  return {0, kTargetThreads};
}

// Blocks of the backward, each a fixed set of rows (b, b + blocks, ...) whose weight-gradient partial
// sum it writes: a fixed assignment keeps the summation order, so the same bits on every run.
inline int64_t backward_blocks(int64_t tokens, int sms, int64_t max_blocks) {
  return std::max<int64_t>(1, std::min<int64_t>({tokens, int64_t(4) * sms, max_blocks}));
}

// Whether the backward kernel holds two rows a thread (the next row's loads in flight through this
// row's reduction): compiled for 1 vector a thread only, where the second row fits the registers without
// spilling (at 2 vectors a thread it spills to the stack).
constexpr bool prefetch_compiled(int vectors_per_thread) { return vectors_per_thread == 1; }

// override: MMFUSE_RMS_NORM_BWD's index (0 auto, 1 prefetch, 2 single); prefetch where compiled.
inline bool backward_prefetch(int vectors_per_thread, int override) {
  return prefetch_compiled(vectors_per_thread) && override != 2;
}

}  // namespace rms_norm
}  // namespace detail
}  // namespace mmfuse
