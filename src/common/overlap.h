// Memory overlap of views, for the entry points' rule that an output shares no memory with an input
// (other than the exact in-place pairs an op documents).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "mmfuse/common.h"

namespace mmfuse {

// Byte range [lo, hi) touched by a view (non-negative strides, as the bindings pass).
inline void byte_range(const TensorView& v, uintptr_t& lo, uintptr_t& hi) {
  int64_t span = 0;
  for (int i = 0; i < v.ndim; ++i)
    if (v.shape[i] > 1) span += (v.shape[i] - 1) * v.stride[i];
  lo = reinterpret_cast<uintptr_t>(v.data);
  hi = lo + uintptr_t(span + 1) * dtype_size(v.dtype);
}

// Whether the byte ranges of two views intersect (views with no elements never do).
inline bool ranges_overlap(const TensorView& a, const TensorView& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  uintptr_t a0, a1, b0, b1;
  byte_range(a, a0, a1);
  byte_range(b, b0, b1);
  return a0 < b1 && b0 < a1;
}

// An output that shares memory with an input: an error naming both.
inline void check_no_overlap(const char* op, const TensorView& out, const char* out_name, const TensorView& in,
                             const char* in_name) {
  MMFUSE_CHECK(!ranges_overlap(out, in), op, ": ", out_name, " overlaps ", in_name,
               ": expected separate memory for every output");
}

// A view and its argument name; a null view (an absent optional argument) is skipped.
struct NamedView {
  const TensorView* v;
  const char* name;
};

// Every output shares no memory with any input nor with another output.
inline void check_outputs_separate(const char* op, std::initializer_list<NamedView> outs,
                                   std::initializer_list<NamedView> ins) {
  for (auto o = outs.begin(); o != outs.end(); ++o) {
    if (!o->v) continue;
    for (const NamedView& i : ins)
      if (i.v) check_no_overlap(op, *o->v, o->name, *i.v, i.name);
    for (auto p = outs.begin(); p != o; ++p)
      if (p->v) check_no_overlap(op, *o->v, o->name, *p->v, p->name);
  }
}

}  // namespace mmfuse
