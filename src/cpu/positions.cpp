// CPU backend of rope_index: one pass per row over its valid tokens, spans from the vision starts,
// grids consumed in order across the batch. Exact integer math; the video time index follows the
// mode's rounding (see RopeIndexMode).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/dispatch.h"
#include "mmfuse/positions.h"

namespace mmfuse {
namespace detail {
namespace {

int64_t time_index(const RopeIndexParams& p, int64_t frame, float sec) {
  if (p.mode == RopeIndexMode::kQwen) {
    volatile float a = float(frame) * sec;  // fp32, rounded, as torch computes it
    volatile float b = a * p.tokens_per_second;
    return int64_t(b);  // truncation toward zero, as Tensor.long()
  }
  const int64_t whole = int64_t(sec);  // the integer cast comes first
  volatile float b = float(frame * whole) * p.tokens_per_second;
  return int64_t(b);
}

}  // namespace

void rope_index_cpu(const TensorView& ids, const TensorView& mask, const TensorView& img, const TensorView& vid,
                    const TensorView& sec, const RopeIndexParams& p, TensorView& pos, TensorView& deltas) {
  const char* op = "rope_index";
  const int64_t B = ids.shape[0], L = ids.shape[1];
  const int64_t n_img = img.defined() ? img.shape[0] : 0, n_vid = vid.defined() ? vid.shape[0] : 0;
  const int m = p.spatial_merge_size;
  int64_t* P = static_cast<int64_t*>(pos.data);
  int64_t* D = static_cast<int64_t*>(deltas.data);
  auto put = [&](int a, int64_t b, int64_t l, int64_t v) { P[a * pos.stride[0] + b * pos.stride[1] + l * pos.stride[2]] = v; };
  int64_t next_img = 0, next_vid = 0;
  std::vector<int64_t> slot;  // valid positions of the row, in order
  for (int64_t b = 0; b < B; ++b) {
    slot.clear();
    for (int64_t l = 0; l < L; ++l) {
      for (int a = 0; a < 3; ++a) put(a, b, l, 1);  // padding value
      if (!mask.defined() || index_at(mask, b, l) == 1) slot.push_back(l);
    }
    const int64_t n = int64_t(slot.size());
    auto tok = [&](int64_t i) { return index_at(ids, b, slot[i]); };
    int64_t st = 0, next = 0, row_max = -1;  // st: first token not placed; next: one past the max so far
    auto text = [&](int64_t from, int64_t to) {
      for (int64_t i = from; i < to; ++i) {
        const int64_t v = next + (i - from);
        for (int a = 0; a < 3; ++a) put(a, b, slot[i], v);
        row_max = std::max(row_max, v);
      }
      if (to > from) next = row_max + 1;
    };
    for (int64_t i = 0; i < n; ++i) {
      if (tok(i) != p.vision_start_token_id) continue;
      MMFUSE_CHECK(i + 1 < n, op, ": row ", b, ": a vision start token is the last valid token");
      const int64_t kind = tok(i + 1);
      const bool is_img = kind == p.image_token_id, is_vid = kind == p.video_token_id;
      if (!is_img && !is_vid) continue;
      const int64_t first = i + 1;
      const TensorView& g = is_img ? img : vid;
      int64_t& gi = is_img ? next_img : next_vid;
      MMFUSE_CHECK(gi < (is_img ? n_img : n_vid), op, ": more ", is_img ? "image" : "video", " spans than ",
                   is_img ? "image_grid_thw" : "video_grid_thw", " rows (", is_img ? n_img : n_vid, ")");
      const int64_t t = index_at(g, gi, 0), h = index_at(g, gi, 1), w = index_at(g, gi, 2);
      MMFUSE_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0, op, ": ",
                   is_img ? "image_grid_thw" : "video_grid_thw", "[", gi, "] = (", t, ", ", h, ", ", w,
                   "): expected positive t, h, w with h and w divisible by spatial_merge_size ", m);
      const float s = is_img ? 0.0f : (sec.defined() ? static_cast<const float*>(sec.data)[gi * sec.stride[0]] : 1.0f);
      ++gi;
      const int64_t hm = h / m, wm = w / m, len = t * hm * wm;
      MMFUSE_CHECK(first + len <= n, op, ": row ", b, ": the vision span at token ", first, " has ", len,
                   " tokens (grid ", t, " x ", hm, " x ", wm, ") but the row has only ", n - first, " valid tokens left");
      for (int64_t k = first; k < first + len; ++k)
        MMFUSE_CHECK(tok(k) == kind, op, ": row ", b, ": the ", is_img ? "image" : "video", " span at token ", first,
                     " should have ", len, " tokens (grid ", t, " x ", hm, " x ", wm, "), but token ", k,
                     " is not an ", is_img ? "image" : "video", " token");
      text(st, first);
      const int64_t base = next;
      int64_t k = first;
      for (int64_t f = 0; f < t; ++f) {
        const int64_t T = is_img ? 0 : time_index(p, f, s);
        for (int64_t r = 0; r < hm; ++r)
          for (int64_t c = 0; c < wm; ++c, ++k) {
            put(0, b, slot[k], base + T);
            put(1, b, slot[k], base + r);
            put(2, b, slot[k], base + c);
            row_max = std::max({row_max, base + T, base + r, base + c});
          }
      }
      next = row_max + 1;
      st = first + len;
      i = st - 1;  // continue after the span
    }
    text(st, n);
    D[b * deltas.stride[0]] = n == 0 ? 0 : row_max + 1 - L;
  }
}

void window_index_cpu(const TensorView& g, int m, int ws, TensorView& idx, TensorView& cu) {
  int64_t* out = static_cast<int64_t*>(idx.data);
  int32_t* c = static_cast<int32_t*>(cu.data);
  int64_t k = 0, w = 0, offset = 0, total = 0;
  c[0] = 0;
  for (int64_t i = 0; i < g.shape[0]; ++i) {
    const int64_t t = index_at(g, i, 0), hm = index_at(g, i, 1) / m, wm = index_at(g, i, 2) / m;
    for (int64_t f = 0; f < t; ++f)
      for (int64_t r0 = 0; r0 < hm; r0 += ws)
        for (int64_t c0 = 0; c0 < wm; c0 += ws) {
          const int64_t r1 = std::min(r0 + ws, hm), c1 = std::min(c0 + ws, wm);
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t cc = c0; cc < c1; ++cc) out[k++ * idx.stride[0]] = offset + (f * hm + r) * wm + cc;
          total += (r1 - r0) * (c1 - c0) * m * m;
          c[++w * cu.stride[0]] = int32_t(total);
        }
    offset += t * hm * wm;
  }
}

}  // namespace detail
}  // namespace mmfuse
