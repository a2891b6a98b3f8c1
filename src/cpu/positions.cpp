// CPU backends of the position family. rope_index: one sequential pass per row over its valid tokens
// (qwen / hf4: spans from the vision starts; hf5: runs of mm_token_type_ids, as transformers 5.x
// walks them), grids consumed in order across the batch, exact integer math; the video time index
// follows the mode's rounding (see RopeIndexMode). Vision: direct loops over the grids.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/dispatch.h"
#include "backends/positions.h"
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
  if (p.mode == RopeIndexMode::kHf5) {  // arange(t) * (tps * int(sec)): integer math for an integer tps
    if (p.tokens_per_second == std::trunc(p.tokens_per_second)) return frame * whole * int64_t(p.tokens_per_second);
    volatile float iv = float(double(p.tokens_per_second) * double(whole));
    volatile float b = float(frame) * iv;
    return int64_t(b);
  }
  volatile float b = float(frame * whole) * p.tokens_per_second;
  return int64_t(b);
}

struct Row {
  const RopeIndexInputs& in;
  const RopeIndexParams& p;
  TensorView& pos;
  int64_t b;
  std::vector<int64_t> slot;  // valid positions of the row, in order
  int64_t row_max = -1;
  void put(int a, int64_t i, int64_t v) {
    static_cast<int64_t*>(pos.data)[a * pos.stride[0] + b * pos.stride[1] + slot[i] * pos.stride[2]] = v;
    row_max = std::max(row_max, v);
  }
  int64_t tok(int64_t i) const { return index_at(in.input_ids, b, slot[i]); }
};

struct GridCursor {
  const TensorView& g;
  const char* name;
  int64_t next = 0;
  // The next grid as merged (t, h/m, w/m), validated.
  void take(int m, int64_t& t, int64_t& hm, int64_t& wm, int64_t& index) {
    const int64_t n = g.defined() ? g.shape[0] : 0;
    MMFUSE_CHECK(next < n, "rope_index: more ", name[0] == 'i' ? "image" : "video", " spans than ", name, " rows (",
                 n, ")");
    index = next++;
    t = index_at(g, index, 0);
    const int64_t h = index_at(g, index, 1), w = index_at(g, index, 2);
    MMFUSE_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0, "rope_index: ", name, "[", index, "] = (",
                 t, ", ", h, ", ", w, "): expected positive t, h, w with h and w divisible by spatial_merge_size ", m);
    hm = h / m;
    wm = w / m;
  }
};

// A video's seconds per grid: finite and in [0, 2^31) (a NaN would make the positions garbage).
float seconds_of(const TensorView& sec, int64_t video) {
  const float s = sec.defined() ? static_cast<const float*>(sec.data)[video * sec.stride[0]] : 1.0f;
  MMFUSE_CHECK(s >= 0.0f && s < 2147483648.0f, "rope_index: second_per_grid_ts[", video, "] = ", s,
               ": expected a finite value in [0, 2^31)");
  return s;
}

// qwen / hf4: spans open at a vision start followed by an image / video token; length from the grid.
void row_qwen(Row& r, GridCursor& img, GridCursor& vid) {
  const char* op = "rope_index";
  const RopeIndexParams& p = r.p;
  const int m = p.spatial_merge_size;
  const int64_t n = int64_t(r.slot.size());
  int64_t st = 0, next = 0;  // st: first token not placed; next: one past the max so far
  auto text = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i)
      for (int a = 0; a < 3; ++a) r.put(a, i, next + (i - from));
    if (to > from) next = r.row_max + 1;
  };
  for (int64_t i = 0; i < n; ++i) {
    if (r.tok(i) != p.vision_start_token_id) continue;
    MMFUSE_CHECK(i + 1 < n, op, ": row ", r.b, ": a vision start token is the last valid token");
    const int64_t kind = r.tok(i + 1);
    const bool is_img = kind == p.image_token_id;
    if (!is_img && kind != p.video_token_id) continue;
    const int64_t first = i + 1;
    int64_t t, hm, wm, gi;
    (is_img ? img : vid).take(m, t, hm, wm, gi);
    const float s = is_img ? 0.0f : seconds_of(r.in.second_per_grid_ts, gi);
    const int64_t len = t * hm * wm;
    MMFUSE_CHECK(first + len <= n, op, ": row ", r.b, ": the vision span at token ", first, " has ", len,
                 " tokens (grid ", t, " x ", hm, " x ", wm, ") but the row has only ", n - first, " valid tokens left");
    for (int64_t k = first; k < first + len; ++k)
      MMFUSE_CHECK(r.tok(k) == kind, op, ": row ", r.b, ": the ", is_img ? "image" : "video", " span at token ",
                   first, " should have ", len, " tokens (grid ", t, " x ", hm, " x ", wm, "), but token ", k,
                   " is not an ", is_img ? "image" : "video", " token");
    text(st, first);
    const int64_t base = next;
    int64_t k = first;
    for (int64_t f = 0; f < t; ++f) {
      const int64_t T = is_img ? 0 : time_index(p, f, s);
      for (int64_t y = 0; y < hm; ++y)
        for (int64_t x = 0; x < wm; ++x, ++k) {
          r.put(0, k, base + T);
          r.put(1, k, base + y);
          r.put(2, k, base + x);
        }
    }
    next = r.row_max + 1;
    st = first + len;
    i = st - 1;  // continue after the span
  }
  text(st, n);
}

// hf5: groups of equal mm_token_type_ids; text advances by its length, a vision group by max(h, w)/m.
void row_hf5(Row& r, GridCursor& img, GridCursor& vid) {
  const char* op = "rope_index";
  const RopeIndexParams& p = r.p;
  const int m = p.spatial_merge_size;
  const int64_t n = int64_t(r.slot.size());
  auto type = [&](int64_t i) { return index_at(r.in.mm_token_type_ids, r.b, r.slot[i]); };
  int64_t cur = 0;
  for (int64_t s = 0, e; s < n; s = e) {
    const int64_t ty = type(s);
    for (e = s + 1; e < n && type(e) == ty; ++e) {
    }
    if (ty == 0) {
      for (int64_t i = s; i < e; ++i)
        for (int a = 0; a < 3; ++a) r.put(a, i, cur + (i - s));
      cur += e - s;
      continue;
    }
    MMFUSE_CHECK(ty == 1 || ty == 2, op, ": row ", r.b, ": mm_token_type_ids: expected 0, 1 or 2, got ", ty,
                 " at token ", s);
    int64_t t, hm, wm, gi;
    (ty == 1 ? img : vid).take(m, t, hm, wm, gi);
    MMFUSE_CHECK(e - s == t * hm * wm, op, ": row ", r.b, ": the ", ty == 1 ? "image" : "video", " run at token ", s,
                 " has ", e - s, " tokens but its grid (", t, " x ", hm, " x ", wm, ") has ", t * hm * wm);
    const float sec = ty == 1 ? 0.0f : seconds_of(r.in.second_per_grid_ts, gi);
    int64_t k = s;
    for (int64_t f = 0; f < t; ++f) {
      const int64_t T = ty == 1 ? f : time_index(p, f, sec);
      for (int64_t y = 0; y < hm; ++y)
        for (int64_t x = 0; x < wm; ++x, ++k) {
          r.put(0, k, cur + T);
          r.put(1, k, cur + y);
          r.put(2, k, cur + x);
        }
    }
    cur += std::max(hm, wm);
  }
}

}  // namespace

void rope_index_cpu(const RopeIndexInputs& in, const RopeIndexParams& p, TensorView& pos, TensorView& deltas) {
  const TensorView& ids = in.input_ids;
  const int64_t B = ids.shape[0], L = ids.shape[1];
  const bool hf5 = p.mode == RopeIndexMode::kHf5;
  const int64_t pad = hf5 ? 0 : 1;
  GridCursor img{in.image_grid_thw, "image_grid_thw"}, vid{in.video_grid_thw, "video_grid_thw"};
  int64_t* D = static_cast<int64_t*>(deltas.data);
  for (int64_t b = 0; b < B; ++b) {
    Row r{in, p, pos, b, {}};
    for (int64_t l = 0; l < L; ++l) {
      for (int a = 0; a < 3; ++a)
        static_cast<int64_t*>(pos.data)[a * pos.stride[0] + b * pos.stride[1] + l * pos.stride[2]] = pad;
      const int64_t mv = in.attention_mask.defined() ? index_at(in.attention_mask, b, l) : 1;
      if (hf5 ? mv != 0 : mv == 1) r.slot.push_back(l);
    }
    hf5 ? row_hf5(r, img, vid) : row_qwen(r, img, vid);
    const int64_t n = int64_t(r.slot.size());
    D[b * deltas.stride[0]] = n == 0 ? 0 : r.row_max + 1 - (hf5 ? n : L);
  }
}

namespace {

struct MergedGrid {
  int64_t t, hm, wm;
};

MergedGrid merged(const TensorView& g, int64_t i, int m) {
  return {index_at(g, i, 0), index_at(g, i, 1) / m, index_at(g, i, 2) / m};
}

}  // namespace

void vision_positions_cpu(const TensorView& g, int m, const TensorView& inv_freq, TensorView& pos, TensorView& ang) {
  const int64_t F = inv_freq.defined() ? inv_freq.shape[0] : 0;
  const float* fr = inv_freq.defined() ? static_cast<const float*>(inv_freq.data) : nullptr;
  int64_t n = 0;
  for (int64_t i = 0; i < g.shape[0]; ++i) {
    const MergedGrid q = merged(g, i, m);
    for (int64_t f = 0; f < q.t; ++f)
      for (int64_t br = 0; br < q.hm; ++br)
        for (int64_t bc = 0; bc < q.wm; ++bc)
          for (int64_t ir = 0; ir < m; ++ir)
            for (int64_t ic = 0; ic < m; ++ic, ++n) {
              const int64_t row = br * m + ir, col = bc * m + ic;
              if (pos.defined()) {
                int64_t* P = static_cast<int64_t*>(pos.data) + n * pos.stride[0];
                P[0] = row;
                P[pos.stride[1]] = col;
              }
              if (ang.defined()) {
                float* A = static_cast<float*>(ang.data) + n * ang.stride[0];
                for (int64_t j = 0; j < F; ++j) {
                  const float fj = fr[j * inv_freq.stride[0]];
                  volatile float a = float(row) * fj, c = float(col) * fj;  // one fp32 multiply each
                  A[j * ang.stride[1]] = a;
                  A[(F + j) * ang.stride[1]] = c;
                }
              }
            }
  }
}

void window_index_cpu(const TensorView& g, int m, int ws, TensorView& idx, TensorView& rev, TensorView& cu,
                      TensorView& cus) {
  int64_t* out = static_cast<int64_t*>(idx.data);
  int32_t* c = static_cast<int32_t*>(cu.data);
  int64_t k = 0, w = 0, frame = 0, offset = 0, total = 0, frame_total = 0;
  c[0] = 0;
  if (cus.defined()) static_cast<int32_t*>(cus.data)[0] = 0;
  for (int64_t i = 0; i < g.shape[0]; ++i) {
    const MergedGrid q = merged(g, i, m);
    for (int64_t f = 0; f < q.t; ++f) {
      for (int64_t r0 = 0; r0 < q.hm; r0 += ws)
        for (int64_t c0 = 0; c0 < q.wm; c0 += ws) {
          const int64_t r1 = std::min(r0 + ws, q.hm), c1 = std::min(c0 + ws, q.wm);
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t cc = c0; cc < c1; ++cc, ++k) {
              const int64_t src = offset + (f * q.hm + r) * q.wm + cc;
              out[k * idx.stride[0]] = src;
              if (rev.defined()) static_cast<int64_t*>(rev.data)[src * rev.stride[0]] = k;
            }
          total += (r1 - r0) * (c1 - c0) * m * m;
          c[++w * cu.stride[0]] = int32_t(total);
        }
      frame_total += q.hm * q.wm * m * m;
      if (cus.defined()) static_cast<int32_t*>(cus.data)[++frame * cus.stride[0]] = int32_t(frame_total);
    }
    offset += q.t * q.hm * q.wm;
  }
}

}  // namespace detail
}  // namespace mmfuse
