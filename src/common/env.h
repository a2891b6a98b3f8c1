// Path knobs: environment variables the backends read at each call, for tests and measurements.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <string>

#include "mmfuse/common.h"

namespace mmfuse {

// The value of environment variable `name` as an index into `choices` (unset or empty: 0, the first
// choice). Any other value fails: "<op>: <name>: expected <a>, <b> or <c>, got '<value>'".
inline int env_choice(const char* op, const char* name, std::initializer_list<const char*> choices) {
  const char* env = std::getenv(name);
  const std::string v = env ? env : "";
  if (v.empty()) return 0;
  const int n = int(choices.size());
  int i = 0;
  for (const char* c : choices) {
    if (v == c) return i;
    ++i;
  }
  std::string list;
  i = 0;
  for (const char* c : choices) {
    list += i == 0 ? "" : i + 1 == n ? " or " : ", ";
    list += c;
    ++i;
  }
  MMFUSE_FAIL(op, ": ", name, ": expected ", list, ", got '", v, "'");
}

}  // namespace mmfuse
