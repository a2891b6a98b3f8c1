// Debug overrides of the automatic kernel-path choices, for tests and measurements: every path
// computes the same function (the same bits, but where a knob says otherwise), so no user needs one. Each is read from its environment variable once, at
// its first use (no environment read on a hot path); tests and benchmarks switch them with
// set_path_override (mmfuse/common.h; from Python: torch.ops.mmfuse._set_path_override).
#pragma once

#include <string>

#include "mmfuse/common.h"

namespace mmfuse {

enum class Knob {
  kMoePlan,      // MMFUSE_MOE_PLAN: auto, cooperative, two
  kMoePlanHist,  // MMFUSE_MOE_PLAN_HIST: auto, wide, narrow
  kMoeBackward,  // MMFUSE_MOE_BWD: auto, tile, general, warp, entry
  kRmsNormBackward,  // MMFUSE_RMS_NORM_BWD: auto, prefetch, single
  kLceGrad,          // MMFUSE_LCE_GRAD: auto, two, cluster (a row's sums in another order: other bits)
};

// The knob's setting: an index into its choices, 0 for auto. The first call reads every knob's
// environment variable; a value that is not one of the choices throws there.
int path_override(Knob knob);

}  // namespace mmfuse
