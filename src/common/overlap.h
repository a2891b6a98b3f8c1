// Memory overlap of views, for the entry points' rule that an output shares no memory with an input
// (other than the exact in-place pairs an op documents).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include <string>

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

// Whether a view's elements fill its byte range (no gaps: a contiguous block in some dim order).
inline bool dense(const TensorView& v) {
  uintptr_t lo, hi;
  byte_range(v, lo, hi);
  return int64_t(hi - lo) == v.numel() * int64_t(dtype_size(v.dtype));
}

// Whether two views share an element. Exact where the byte ranges are disjoint, where both views are
// dense, and where both have one layout (the same strides: e.g. q and k as head slices of one fused
// qkv buffer), by solving d = sum_k (i_k - j_k) * stride_k for the distance d between the bases, dim
// by dim from the largest stride; a layout with too many candidates at one dim (strides that do not
// nest) is taken as separate, as PyTorch's own overlap check does with layouts it cannot decide.
inline bool views_overlap(const TensorView& a, const TensorView& b) {
  if (!ranges_overlap(a, b)) return false;
  if (dense(a) && dense(b)) return true;
  if (a.ndim != b.ndim || a.dtype != b.dtype) return false;
  const int64_t es = int64_t(dtype_size(a.dtype));
  int64_t d = int64_t(static_cast<const char*>(b.data) - static_cast<const char*>(a.data));
  if (d % es) return false;
  d /= es;
  int dims[kMaxDims], n = 0;  // dims of extent > 1 in either view, by decreasing stride
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] <= 1 && b.shape[i] <= 1) continue;
    if (a.stride[i] != b.stride[i] || a.stride[i] <= 0) return false;
    dims[n++] = i;
  }
  std::sort(dims, dims + n, [&](int x, int y) { return a.stride[x] > a.stride[y]; });
  int64_t reach[kMaxDims + 1] = {};  // reach[x]: the most |sum over dims x.. of (i - j) * stride|
  for (int x = n - 1; x >= 0; --x)
    reach[x] = reach[x + 1] + (std::max(a.shape[dims[x]], b.shape[dims[x]]) - 1) * a.stride[dims[x]];
  constexpr int64_t kMaxCandidates = 64;
  auto meets = [&](auto&& self, int x, int64_t rem) -> bool {
    if (x == n) return rem == 0;
    const int i = dims[x];
    const int64_t st = a.stride[i], r = reach[x + 1];
    auto floor_div = [](int64_t p, int64_t q) { return p >= 0 ? p / q : -((-p + q - 1) / q); };
    // delta = i_k - j_k in (-b.shape, a.shape) with |rem - delta * st| <= r
    const int64_t lo = std::max<int64_t>(1 - b.shape[i], -floor_div(-(rem - r), st));
    const int64_t hi = std::min<int64_t>(a.shape[i] - 1, floor_div(rem + r, st));
    if (hi - lo >= kMaxCandidates) return false;  // strides that do not nest: not decided here
    for (int64_t delta = lo; delta <= hi; ++delta)
      if (self(self, x + 1, rem - delta * st)) return true;
    return false;
  };
  return meets(meets, 0, d);
}

// Whether two views are the same elements in the same order (an exact in-place pair; two absent views
// count as the same).
inline bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.stride[i] != b.stride[i])) return false;
  return true;
}

// A view that writes some element twice (a stride-0 dim of extent > 1: an expanded tensor).
inline bool expanded(const TensorView& v) {
  if (v.numel() == 0) return false;  // no element to write twice
  for (int i = 0; i < v.ndim; ++i)
    if (v.shape[i] > 1 && v.stride[i] == 0) return true;
  return false;
}

// An output that shares memory with an input: an error naming both.
inline void check_no_overlap(const char* op, const TensorView& out, const char* out_name, const TensorView& in,
                             const char* in_name) {
  MMFUSE_CHECK(!views_overlap(out, in), op, ": ", out_name, " overlaps ", in_name,
               ": expected separate memory for every output");
}

// A view and its argument name; a null view (an absent optional argument) is skipped.
struct NamedView {
  const TensorView* v;
  const char* name;
};

// An output that is expanded (stride 0 along a dim of extent > 1): an error naming it.
inline void check_not_expanded(const char* op, const TensorView& out, const char* name) {
  MMFUSE_CHECK(!out.defined() || !expanded(out), op, ": ", name, " is expanded (a stride of 0 along a dim of ",
               "more than one element): every output element must have memory of its own, got strides ",
               [&] {
                 std::string s = "[";
                 for (int i = 0; i < out.ndim; ++i) s += (i ? ", " : "") + std::to_string(out.stride[i]);
                 return s + "]";
               }());
}

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
