// The work schedules of the persistent sm_90a dual GEMM (dual_gemm_sm90.cu): which k-blocks of which
// units each cluster runs, and where a unit split across clusters is summed. Plain C++ shared by the
// kernel, its host launcher and a CPU test (tests/cpp/test_dual_gemm.cpp, DualGemmSchedule.*).
//
// The work unit is a pair of output tiles (one a CTA of a cluster of two); unit u belongs to problem
// 0 (schedule order) if u < units[0], else to problem 1, and has kblocks[e] k-blocks.
//
// Tiles: cluster g runs units g, g + G, ... whole (G = clusters).
// Stream-K: the same for the first dp_units units (all but the last one to two waves: a multiple of
// G), then the k-blocks of the remaining units, in order, form one sequence of iterations, numbered
// on from the whole units' (`dp_iters` .. `iters`), and cluster g owns the share
// [dp_iters + g R / G, dp_iters + (g + 1) R / G) of those R = iters - dp_iters (G <= R: no share is
// empty), cut into segments, each a run of k-blocks of one unit, which it runs from the share's end
// back to its start. The whole-unit waves keep the L2 reuse of the tiles order (the units in flight
// at once are neighbours); the shares level the tail.
//
// A unit cut between clusters h < ... < g: the segment that ends inside the unit (only a share's
// last, which its cluster runs first) writes its fp32 partial to the workspace slots of its cluster
// and raises their flags: it "spills". The segment that holds the unit's last k-block but not its
// first (only a share's first, which its cluster runs last) waits for the flags of clusters h .. g -
// 1, adds their partials in that order and stores the unit: it "gathers". The sum order depends on
// the shapes and G alone, so results are bitwise reproducible. A cluster spills before it waits on
// anything, and waits only on clusters of lower index, which the GPU starts first (it dispatches
// blocks in index order in practice; CUDA does not promise it): so the kernel does not deadlock
// when other work keeps some of its clusters from being resident at once. The gathering cluster
// meets the unit at the end of its share, long after the spills it needs.
#pragma once

#include <algorithm>
#include <cstddef>

#if defined(__CUDACC__)
#define MMFUSE_SCHEDULE_FN __host__ __device__ __forceinline__
#else
#define MMFUSE_SCHEDULE_FN inline
#endif

namespace mmfuse {
namespace detail {

enum ScheduleMode : int { kScheduleAuto = 0, kScheduleTiles = 1, kScheduleStreamK = 2 };

struct Schedule {
  int units[2];        // units of each problem, in schedule order
  int kblocks[2];      // k-blocks of each of its units (>= 1)
  int total_units;     // units[0] + units[1]
  int clusters;        // G: clusters of the grid
  int kind;            // what runs: kScheduleTiles or kScheduleStreamK
  int dp_units;        // units run whole, round robin (all of them under tiles)
  long long dp_iters;  // their k-blocks: the shares' iterations start here
  long long iters;     // k-blocks of all units
  int slots;           // workspace slots of partials (0: none; stream-K: one a cluster)
};

struct Segment {
  int u, kb_begin, kb_end;  // unit, and its k-blocks [kb_begin, kb_end)
  bool spill, gather;
  int slot;      // spill: the workspace slot written; gather: the first slot added
  int partials;  // gather: slots slot + h, h < partials, in k order
};

struct Walk {
  long long begin, it;  // stream-K: the share's first iteration, and the end of what is left of it
  int u;                // tiles: the next unit
  int g;                // the cluster
};

MMFUSE_SCHEDULE_FN long long share_begin(const Schedule& s, int g) {
  return s.dp_iters + (s.iters - s.dp_iters) * g / s.clusters;
}

MMFUSE_SCHEDULE_FN Walk walk_start(const Schedule& s, int g) {
  return {share_begin(s, g), share_begin(s, g + 1), g, g};
}

// The clusters whose spilled partials a gathering segment of cluster g adds: first .. g - 1.
MMFUSE_SCHEDULE_FN int gather_first(const Schedule& s, int g, long long unit_begin) {
  int h = g - 1;
  while (h > 0 && share_begin(s, h) > unit_begin) --h;
  return h;
}

// Cluster g's next segment (w from walk_start(s, g)): its whole units, then its share from the end
// back; false once its work is done.
MMFUSE_SCHEDULE_FN bool next_segment(const Schedule& s, Walk& w, Segment& seg) {
  if (w.u < s.dp_units) {  // a whole unit
    seg = {w.u, 0, s.kblocks[w.u >= s.units[0]], false, false, 0, 0};
    w.u += s.clusters;
    return true;
  }
  if (w.it <= w.begin) return false;  // (under tiles every share is empty)
  const long long first = (long long)s.units[0] * s.kblocks[0];  // iterations of problem 0
  const long long last = w.it - 1;                              // the segment's last iteration
  const int e = last >= first;
  const long long rel = e ? last - first : last;
  const int kbs = s.kblocks[e];
  const int kb_last = int(rel % kbs);
  const long long unit_begin = last - kb_last, seg_begin = unit_begin > w.begin ? unit_begin : w.begin;
  const int kb_begin = int(seg_begin - unit_begin);
  const bool spill = kb_last + 1 < kbs, gather = kb_last + 1 == kbs && kb_begin > 0;
  const int from = gather ? gather_first(s, w.g, unit_begin) : w.g;
  seg = {(e ? s.units[0] : 0) + int(rel / kbs), kb_begin, kb_last + 1, spill, gather, from, gather ? w.g - from : 0};
  w.it = seg_begin;
  return true;
}

// Workspace of `slots` slots of partials (stream-K: one a cluster), each of kPartsPerSlot parts, one
// a (CTA rank, consumer warpgroup) of the unit: a 64-bit flag a part (256-byte aligned), then an fp32
// partial block a part (one warpgroup's 128 threads x 128 accumulators).
constexpr int kPartsPerSlot = 4;
constexpr int kPartialFloats = 128 * 128;
inline size_t schedule_flag_bytes(int slots) { return (size_t(slots) * kPartsPerSlot * 8 + 255) / 256 * 256; }
inline size_t schedule_workspace_bytes(int slots) {
  return schedule_flag_bytes(slots) + size_t(slots) * kPartsPerSlot * kPartialFloats * sizeof(float);
}

// k-blocks of the busiest cluster when g clusters run units [0, limit) whole, round robin.
inline long long tiles_makespan(const Schedule& s, int g, int limit) {
  long long worst = 0;
  for (int c = 0; c < g && c < limit; ++c) {
    const long long all = (limit - c + g - 1) / g;  // units c, c + g, ... below limit
    const int first_end = std::min(s.units[0], limit);
    const long long first = c < first_end ? (first_end - c + g - 1) / g : 0;  // of them problem 0's
    worst = std::max(worst, first * s.kblocks[0] + (all - first) * s.kblocks[1]);
  }
  return worst;
}

// k-blocks of units [0, n).
inline long long schedule_iters(const Schedule& s, int n) {
  const int first = std::min(n, s.units[0]);
  return (long long)first * s.kblocks[0] + (long long)(n - first) * s.kblocks[1];
}

// Auto takes stream-K only for units of at least kStreamKMinKBlocks k-blocks (k >= 4096), and where
// its busiest cluster (whole units plus its share) has more than kSplitCost k-blocks less to do than
// the tiles schedule's. Measured (H100, 2026-12-05 21:28, docs/benchmarks.md), stream-K against tiles
// on the 12 benchmark GEMMs: 1.6-28 % faster on all 7 whose units have 128-344 k-blocks; on the 5
// whose units have 16-32, from 0.2 % faster to 12 % slower. A unit of 16-32 k-blocks lasts 11-22 us,
// so a split's fixed costs weigh more there: the fp32 partials written and added, and (likely) the
// clusters' shares starting at different k, so that clusters no longer read the same operand blocks
// at the same time as under the tiles order.
constexpr int kStreamKMinKBlocks = 64;
constexpr long long kSplitCost = 4;

// The schedule of units[e] units of kblocks[e] k-blocks each on at most max_clusters clusters:
// `mode` kScheduleTiles or kScheduleStreamK forces one (stream-K only where workspace_bytes holds
// its slots); kScheduleAuto as above.
inline Schedule make_schedule(const int (&units)[2], const int (&kblocks)[2], int max_clusters, int mode,
                              size_t workspace_bytes) {
  Schedule s{};
  for (int e = 0; e < 2; ++e) {
    s.units[e] = units[e];
    s.kblocks[e] = std::max(1, kblocks[e]);
  }
  s.total_units = units[0] + units[1];
  s.iters = schedule_iters(s, s.total_units);
  const int tiles_g = std::max(1, std::min(s.total_units, max_clusters));
  // stream-K: G clusters (at most one a k-block); whole units for all waves but the last full one
  const int sk_g = int(std::max(1LL, std::min<long long>(s.iters, max_clusters)));
  const int waves = s.total_units / sk_g;
  const int dp = waves >= 2 ? (waves - 1) * sk_g : 0;
  const long long dp_iters = schedule_iters(s, dp);
  const long long sk_span = tiles_makespan(s, sk_g, dp) + (s.iters - dp_iters + sk_g - 1) / sk_g;
  bool sk = mode == kScheduleStreamK ||
            (mode == kScheduleAuto && s.kblocks[0] >= kStreamKMinKBlocks &&
             tiles_makespan(s, tiles_g, s.total_units) > sk_span + kSplitCost);
  sk = sk && s.total_units > 0 && workspace_bytes >= schedule_workspace_bytes(sk_g);
  s.kind = sk ? kScheduleStreamK : kScheduleTiles;
  s.clusters = sk ? sk_g : tiles_g;
  s.dp_units = sk ? dp : s.total_units;
  s.dp_iters = sk ? dp_iters : s.iters;
  s.slots = sk ? sk_g : 0;
  return s;
}

}  // namespace detail
}  // namespace mmfuse
