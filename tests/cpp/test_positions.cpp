// rope_index on the CPU: a hand-worked case, padding, grids consumed across rows, the two modes'
// time index, and bad input. (The release fixtures are checked from Python: tests/python.)
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "mmfuse/positions.h"

using namespace mmfuse;

namespace {

constexpr int64_t V = 9, I = 7, W = 6;  // vision start, image, video token ids

struct Result {
  std::vector<int64_t> pos, deltas;
};

Result run(std::vector<int64_t> ids, std::vector<int64_t> mask, int64_t B, std::vector<int64_t> img,
        std::vector<int64_t> vid, std::vector<float> sec, RopeIndexMode mode = RopeIndexMode::kQwen) {
  const int64_t L = int64_t(ids.size()) / B;
  const Device cpu{DeviceType::kCPU, 0};
  int64_t s2[2] = {B, L}, si[2] = {int64_t(img.size()) / 3, 3}, sv[2] = {int64_t(vid.size()) / 3, 3};
  int64_t ss[1] = {int64_t(sec.size())}, sp[3] = {3, B, L}, sd[2] = {B, 1};
  Result r;
  r.pos.assign(3 * B * L, -99);  // poisoned
  r.deltas.assign(B, -99);
  TensorView tid = make_contiguous_view(ids.data(), DType::kInt64, cpu, 2, s2);
  TensorView tm = mask.empty() ? TensorView{} : make_contiguous_view(mask.data(), DType::kInt64, cpu, 2, s2);
  TensorView ti = img.empty() ? TensorView{} : make_contiguous_view(img.data(), DType::kInt64, cpu, 2, si);
  TensorView tv = vid.empty() ? TensorView{} : make_contiguous_view(vid.data(), DType::kInt64, cpu, 2, sv);
  TensorView ts = sec.empty() ? TensorView{} : make_contiguous_view(sec.data(), DType::kFloat32, cpu, 1, ss);
  TensorView tp = make_contiguous_view(r.pos.data(), DType::kInt64, cpu, 3, sp);
  TensorView td = make_contiguous_view(r.deltas.data(), DType::kInt64, cpu, 2, sd);
  RopeIndexParams p;
  p.mode = mode;
  p.image_token_id = I;
  p.video_token_id = W;
  p.vision_start_token_id = V;
  rope_index(tid, tm, ti, tv, ts, p, tp, td, nullptr);
  return r;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(RopeIndexCpu, HandWorkedImageWithLeftPadding) {
  // [pad, t, t, <vs>, img x 4 (grid 1x4x4, merge 2 -> 2x2), <ve>, t]
  Result r = run({0, 5, 5, V, I, I, I, I, 8, 5}, {0, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 1, {1, 4, 4}, {}, {});
  EXPECT_EQ(r.pos, (std::vector<int64_t>{1, 0, 1, 2, 3, 3, 3, 3, 5, 6,    // T
                                         1, 0, 1, 2, 3, 3, 4, 4, 5, 6,    // H
                                         1, 0, 1, 2, 3, 4, 3, 4, 5, 6}));  // W
  EXPECT_EQ(r.deltas, (std::vector<int64_t>{6 + 1 - 10}));
}

TEST(RopeIndexCpu, VideoTimeIndexPerMode) {
  // one video, 3 frames of 1x1 merged tokens (grid 3x2x2), 0.5 s a grid, 2 tokens per second
  std::vector<int64_t> ids = {V, W, W, W, 5};
  Result q = run(ids, {}, 1, {}, {3, 2, 2}, {0.5f}, RopeIndexMode::kQwen);
  Result h = run(ids, {}, 1, {}, {3, 2, 2}, {0.5f}, RopeIndexMode::kHf4);
  // qwen: T = trunc(i * 0.5 * 2) = i; hf4: trunc(i * int(0.5) * 2) = 0
  EXPECT_EQ(std::vector<int64_t>(q.pos.begin(), q.pos.begin() + 5), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(std::vector<int64_t>(h.pos.begin(), h.pos.begin() + 5), (std::vector<int64_t>{0, 1, 1, 1, 2}));
  Result none = run(ids, {}, 1, {}, {3, 2, 2}, {});  // absent: 1 s a grid -> T = 2i
  EXPECT_EQ(std::vector<int64_t>(none.pos.begin(), none.pos.begin() + 5), (std::vector<int64_t>{0, 1, 3, 5, 6}));
}

TEST(RopeIndexCpu, GridsAcrossRowsPaddingAndEmptyRows) {
  // row 0: image A (1x2x2 -> 1 token); row 1: all padding; row 2: image B (1x2x4 -> 2 tokens)
  Result r = run({V, I, 5, 5, 0, 0, 0, 0, V, I, I, 5}, {1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1}, 3, {1, 2, 2, 1, 2, 4}, {},
              {});
  EXPECT_EQ(r.deltas, (std::vector<int64_t>{3 + 1 - 4, 0, 3 + 1 - 4}));
  // row 2, W axis: vs 0, image 1 1 -> w 1, 2, then text 3
  EXPECT_EQ(std::vector<int64_t>(r.pos.begin() + 2 * 12 + 8, r.pos.begin() + 2 * 12 + 12),
            (std::vector<int64_t>{0, 1, 2, 3}));
  for (int a = 0; a < 3; ++a)
    for (int l = 4; l < 8; ++l) EXPECT_EQ(r.pos[a * 12 + l], 1);  // the all-padding row
}

TEST(RopeIndexCpu, BadInputNamesTheProblem) {
  expect_error([] { run({V, I, V, I}, {}, 1, {1, 2, 2}, {}, {}); }, "more image spans than image_grid_thw rows (1)");
  expect_error([] { run({V, I, I}, {}, 1, {1, 4, 4}, {}, {}); }, "has only 2 valid tokens left");
  expect_error([] { run({V, I, 5}, {}, 1, {1, 3, 2}, {}, {}); }, "divisible by spatial_merge_size 2");
  expect_error([] { run({5, V}, {}, 1, {1, 2, 2}, {}, {}); }, "vision start token is the last valid token");
  expect_error([] { run({V, I, I, 5, 5}, {}, 1, {1, 2, 6}, {}, {}); }, "token 3 is not an image token");
  expect_error([] { run({V, W, 5}, {}, 1, {}, {1, 2, 2}, {1.0f, 2.0f}); }, "second_per_grid_ts: expected shape [1]");
}

TEST(WindowIndexCpu, HandWorkedPartialAndExactWindows) {
  // grid A: 1 x (6/2=3) x (10/2=5) merged, ws = 112/2/14 = 4 -> windows 1 x 2 (partial col, rows);
  // grid B: 2 frames x (8/2=4) x (8/2=4): exactly one window a frame (HF's empty pad windows removed)
  std::vector<int64_t> g = {1, 6, 10, 2, 8, 8};
  const Device cpu{DeviceType::kCPU, 0};
  int64_t sg[2] = {2, 3};
  TensorView gv = make_contiguous_view(g.data(), DType::kInt64, cpu, 2, sg);
  const WindowIndexSizes s = window_index_sizes(gv, 2, 112, 14);
  EXPECT_EQ(s.tokens, 15 + 32);
  EXPECT_EQ(s.windows, 2 + 2);
  std::vector<int64_t> idx(s.tokens, -99);
  std::vector<int32_t> cu(s.windows + 1, -99);
  int64_t si[1] = {s.tokens}, sc[1] = {s.windows + 1};
  TensorView iv = make_contiguous_view(idx.data(), DType::kInt64, cpu, 1, si);
  TensorView cv = make_contiguous_view(cu.data(), DType::kInt32, cpu, 1, sc);
  window_index(gv, 2, 112, 14, iv, cv, nullptr);
  // grid A (3 x 5, row-major ids 0..14): window (0,0) rows 0-2 cols 0-3; (0,1) rows 0-2 col 4
  std::vector<int64_t> a = {0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 4, 9, 14};
  EXPECT_EQ(std::vector<int64_t>(idx.begin(), idx.begin() + 15), a);
  for (int64_t i = 15; i < 47; ++i) EXPECT_EQ(idx[i], i);  // grid B: one window a frame, in order
  // patches a window: A (0,0) 3 x 4 merged = 48, A (0,1) 3 x 1 = 12; B 16 merged = 64 a frame
  EXPECT_EQ(cu, (std::vector<int32_t>{0, 48, 60, 124, 188}));
}
