#include "common/overrides.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>

namespace mmfuse {
namespace {

struct KnobInfo {
  const char* env;
  const char* op;
  std::array<const char*, 5> choices;  // nullptr-terminated when fewer
};

constexpr KnobInfo kKnobs[] = {
    {"MMFUSE_MOE_PLAN", "moe_plan", {"auto", "cooperative", "two", nullptr, nullptr}},
    {"MMFUSE_MOE_PLAN_HIST", "moe_plan", {"auto", "wide", "narrow", nullptr, nullptr}},
    {"MMFUSE_MOE_BWD", "moe_unpermute_backward", {"auto", "tile", "general", "warp", "entry"}},
    {"MMFUSE_RMS_NORM_BWD", "rms_norm_backward", {"auto", "prefetch", "single", nullptr, nullptr}},
    {"MMFUSE_LCE_GRAD", "linear_cross_entropy_logits_grad", {"auto", "two", "cluster", nullptr, nullptr}},
};
constexpr int kNumKnobs = int(sizeof(kKnobs) / sizeof(kKnobs[0]));

std::array<std::atomic<int>, kNumKnobs> g_value{};

int choice_index(const KnobInfo& k, const std::string& v) {
  if (v.empty()) return 0;
  std::string list;
  int n = 0;
  while (n < int(k.choices.size()) && k.choices[n]) ++n;
  for (int i = 0; i < n; ++i) {
    if (v == k.choices[i]) return i;
    list += i == 0 ? "" : i + 1 == n ? " or " : ", ";
    list += k.choices[i];
  }
  MMFUSE_FAIL(k.op, ": ", k.env, ": expected ", list, ", got '", v, "'");
}

void read_environment() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int i = 0; i < kNumKnobs; ++i) {
      const char* env = std::getenv(kKnobs[i].env);
      g_value[i].store(choice_index(kKnobs[i], env ? env : ""), std::memory_order_relaxed);
    }
  });
}

}  // namespace

int path_override(Knob knob) {
  read_environment();
  return g_value[int(knob)].load(std::memory_order_relaxed);
}

void set_path_override(const std::string& name, const std::string& value) {
  read_environment();
  std::string names;
  for (int i = 0; i < kNumKnobs; ++i) {
    if (name == kKnobs[i].env) return g_value[i].store(choice_index(kKnobs[i], value), std::memory_order_relaxed);
    names += i == 0 ? "" : ", ";
    names += kKnobs[i].env;
  }
  MMFUSE_FAIL("set_path_override: name: expected one of ", names, ", got '", name, "'");
}

}  // namespace mmfuse
