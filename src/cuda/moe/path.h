// Path choice of the MoE routing's CUDA backend: pure host functions of shapes and the kernels'
// architecture, so that the rule is unit-tested on the CPU. The numbers behind each threshold are in
// docs/design/moe.md. Every path computes the same bits; the overrides exist for tests and
// measurements only (common/overrides.h).
#pragma once

#include <algorithm>
#include <cstdint>

namespace mmfuse {
namespace detail {
namespace moe {

// ---- plan ----
// A plan block: 8 warps, 2 ids a lane a tile (4 ids a lane, or 4 warps, made every plan slower).
constexpr int kPlanWarps = 8, kPlanThreads = kPlanWarps * 32, kPlanItems = 2;
static_assert(kPlanThreads * kPlanItems == 512, "the tile of moe_plan_block_entries");
// 16-bit chunk histograms from this many experts on: halving the column sums' bytes pays only where a
// thread would otherwise make one round trip for every 256 experts.
constexpr int64_t kPlanNarrowExperts = 512;

enum class PlanLaunch { kAuto, kCooperative, kTwo };  // override: MMFUSE_MOE_PLAN
enum class PlanHist { kAuto, kWide, kNarrow };         // override: MMFUSE_MOE_PLAN_HIST

struct PlanPath {
  bool cooperative;  // one cooperative launch: count, grid barrier, rank
  bool pdl;          // else the count and rank kernels, as programmatic dependent launches where true
  bool narrow;       // 16-bit chunk histograms
};

// arch: the plan kernels' architecture (90 for sm_90a); per_block: entries a chunk; chunks: blocks;
// resident: plan blocks resident at once; ws_aligned: the workspace is 16-byte aligned.
// On sm_90+ with one tile a warp, the two kernels as dependent launches beat the cooperative kernel
// (no grid barrier, the recount overlaps the count); with more tiles a warp the recount costs more.
inline PlanPath plan_path(int arch, int64_t E, int64_t per_block, int64_t chunks, int64_t resident, bool ws_aligned,
                          PlanLaunch launch = PlanLaunch::kAuto, PlanHist hist = PlanHist::kAuto) {
  const bool sm90 = arch >= 90, one_tile = per_block <= kPlanThreads * kPlanItems, fits = chunks <= resident;
  PlanPath p{};
  p.cooperative = launch == PlanLaunch::kCooperative ? fits
                                                      : launch == PlanLaunch::kAuto && fits && !(sm90 && one_tile);
  p.pdl = !p.cooperative && launch == PlanLaunch::kAuto && sm90;
  // a chunk's count of one expert must fit 16 bits, and the 16-byte loads need an aligned workspace
  p.narrow = hist != PlanHist::kWide && per_block <= 0xffff && ws_aligned &&
             (hist == PlanHist::kNarrow || E >= kPlanNarrowExperts);
  return p;
}

// ---- permute ----
struct PermutePath {
  int k_group;     // map entries read a step (2 where K >= 2: one round trip for two rows)
  bool streaming;  // streaming stores (K >= 4: the K copies would evict rows still to be read)
};
inline PermutePath permute_path(int64_t K) { return {K >= 2 ? 2 : 1, K >= 4}; }

// ---- unpermute ----
enum class UnpermuteKernel { kWarp, kTile, kFlat };
struct UnpermutePath {
  UnpermuteKernel kernel;
  int k_group, chunk;  // kWarp: rows a token (K) and 16-byte vectors a lane at a time
};
// K <= 2: a warp a token (rows in flight in registers); K >= 3: the token-tile kernel where it
// applies (tile_fits), else the flat kernel. vectors: 16-byte (or narrower) vectors a row.
inline UnpermutePath unpermute_path(int64_t K, int64_t vectors, bool tile_fits) {
  if (K == 2) return {UnpermuteKernel::kWarp, 2, 4};
  if (K <= 1) return {UnpermuteKernel::kWarp, 1, vectors >= 256 ? 8 : 4};
  return {tile_fits ? UnpermuteKernel::kTile : UnpermuteKernel::kFlat, 0, 0};
}

// ---- unpermute backward ----
enum class BwdKernel { kWarpToken, kWarpEntry, kTile, kGeneral };
enum class BwdForce { kAuto, kTile, kGeneral, kWarpToken, kWarpEntry };  // override: MMFUSE_MOE_BWD
// The largest token (dout and K rows of y) the backward's tile kernel stages: beyond, fewer stages
// than consumer warps fit, and a warp an entry is faster.
constexpr int64_t kBwdTileMaxStageBytes = 48 * 1024;

// tile_fits: the tile kernel can take the rows (tile_shape below) and a stage is at most
// kBwdTileMaxStageBytes. A warp a token at K = 1, a warp an entry at K = 2 and where the tile kernel
// does not fit; the general kernel only where T * K passes the warp kernels' 32-bit item index.
inline BwdKernel unpermute_backward_path(int64_t T, int64_t K, bool tile_fits, BwdForce force = BwdForce::kAuto) {
  const bool entry_ok = K >= 1 && T * K < (int64_t(1) << 31);
  switch (force) {
    case BwdForce::kWarpEntry:
      if (entry_ok) return BwdKernel::kWarpEntry;
      break;
    case BwdForce::kWarpToken:
      if (K == 1) return BwdKernel::kWarpToken;
      break;
    case BwdForce::kTile: return tile_fits ? BwdKernel::kTile : BwdKernel::kGeneral;
    case BwdForce::kGeneral: return BwdKernel::kGeneral;
    case BwdForce::kAuto: break;
  }
  if (entry_ok && K == 2) return BwdKernel::kWarpEntry;
  if (K == 1) return BwdKernel::kWarpToken;
  if (tile_fits) return BwdKernel::kTile;
  return entry_ok ? BwdKernel::kWarpEntry : BwdKernel::kGeneral;
}

// ---- token-tile kernels (sm_90+) ----
constexpr int kTileMaxK = 8, kTileMaxStages = 16, kTileConsumers = 8, kTileMaxProducers = 2;
constexpr int64_t kTileSmemBudget = 224 * 1024;
// a stage's slot (kTileMaxK map entries and weights) and its two barriers
constexpr int64_t kTileStageExtra = kTileMaxK * (4 + 4) + 16;

struct TileShape {
  int stages = 0;     // 0: the tile kernel does not apply
  int seqs = 0;       // stage sequences (token m to sequence m % seqs)
  int producers = 0;  // producer warps
};
// Rows of 16-byte vectors, 1 <= K <= kTileMaxK, two stages at least in the shared-memory budget, an
// sm_90+ kernel. Two producer warps where each can own a set of stages (an even number of sequences,
// or of stages in one sequence): a producer's per-token steps are a serial chain.
inline TileShape tile_shape(int arch, int64_t K, int64_t T, int64_t row_bytes, int64_t stage_bytes, int max_seqs) {
  TileShape s;
  if (K < 1 || K > kTileMaxK || T < 1 || row_bytes % 16 != 0 || arch < 90) return s;
  const int fit = int(std::min<int64_t>(kTileMaxStages, kTileSmemBudget / (stage_bytes + kTileStageExtra)));
  if (fit < 2) return s;
  s.seqs = std::min(max_seqs, fit);
  s.stages = fit / s.seqs * s.seqs;
  s.producers = (s.seqs > 1 ? s.seqs : s.stages) % 2 == 0 ? kTileMaxProducers : 1;
  return s;
}

}  // namespace moe
}  // namespace detail
}  // namespace mmfuse
