// The position family: rope_index on the CPU (hand-worked cases, padding, grids consumed across rows,
// the modes' time index, hf5 runs, bad input), the vision positions and window index (hand-worked),
// and the CUDA backends against the CPU ones, exactly, on random batches (skipped without a GPU).
// The release fixtures and transformers itself are checked from Python (tests/python).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mmfuse/positions.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

constexpr int64_t V = 9, I = 7, W = 6;  // vision start, image, video token ids

struct Batch {
  int64_t B = 1;
  std::vector<int64_t> ids, mask, types, img, vid;
  std::vector<float> sec;
  RopeIndexMode mode = RopeIndexMode::kQwen;
  float tps = 2.0f;
  int64_t L() const { return int64_t(ids.size()) / B; }
};

struct Result {
  std::vector<int64_t> pos, deltas;
};

RopeIndexParams params_of(const Batch& b) {
  RopeIndexParams p;
  p.mode = b.mode;
  p.image_token_id = I;
  p.video_token_id = W;
  p.vision_start_token_id = V;
  p.tokens_per_second = b.tps;
  return p;
}

// Views of the batch's vectors (on the CPU, or of the device buffers given).
RopeIndexInputs inputs_of(Batch& b, Device dev, const std::vector<void*>& data) {
  auto v = [&](int k, std::vector<int64_t>& h, std::vector<int64_t> shape) {
    if (h.empty()) return TensorView{};
    return make_contiguous_view(data.empty() ? h.data() : data[k], DType::kInt64, dev, int(shape.size()), shape.data());
  };
  RopeIndexInputs in;
  in.input_ids = v(0, b.ids, {b.B, b.L()});
  in.attention_mask = v(1, b.mask, {b.B, b.L()});
  in.mm_token_type_ids = v(2, b.types, {b.B, b.L()});
  in.image_grid_thw = v(3, b.img, {int64_t(b.img.size()) / 3, 3});
  in.video_grid_thw = v(4, b.vid, {int64_t(b.vid.size()) / 3, 3});
  if (!b.sec.empty()) {
    int64_t s[1] = {int64_t(b.sec.size())};
    in.second_per_grid_ts = make_contiguous_view(data.empty() ? b.sec.data() : data[5], DType::kFloat32, dev, 1, s);
  }
  return in;
}

Result run_cpu(Batch b) {
  Result r;
  r.pos.assign(3 * b.B * b.L(), -99);  // poisoned
  r.deltas.assign(b.B, -99);
  RopeIndexInputs in = inputs_of(b, Device{}, {});
  TensorView tp = host_view(r.pos.data(), DType::kInt64, {3, b.B, b.L()});
  TensorView td = host_view(r.deltas.data(), DType::kInt64, {b.B, 1});
  TensorView ws;
  rope_index(in, params_of(b), tp, td, ws, nullptr);
  return r;
}

Result run(std::vector<int64_t> ids, std::vector<int64_t> mask, int64_t B, std::vector<int64_t> img,
           std::vector<int64_t> vid, std::vector<float> sec, RopeIndexMode mode = RopeIndexMode::kQwen) {
  Batch b;
  b.B = B;
  b.ids = ids;
  b.mask = mask;
  b.img = img;
  b.vid = vid;
  b.sec = sec;
  b.mode = mode;
  return run_cpu(b);
}

std::vector<int64_t> slice(const std::vector<int64_t>& v, size_t from, size_t n) {
  return std::vector<int64_t>(v.begin() + from, v.begin() + from + n);
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
  EXPECT_EQ(slice(q.pos, 0, 5), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(slice(h.pos, 0, 5), (std::vector<int64_t>{0, 1, 1, 1, 2}));
  Result none = run(ids, {}, 1, {}, {3, 2, 2}, {});  // absent: 1 s a grid -> T = 2i
  EXPECT_EQ(slice(none.pos, 0, 5), (std::vector<int64_t>{0, 1, 3, 5, 6}));
}

TEST(RopeIndexCpu, GridsAcrossRowsPaddingAndEmptyRows) {
  // row 0: image A (1x2x2 -> 1 token); row 1: all padding; row 2: image B (1x2x4 -> 2 tokens)
  Result r = run({V, I, 5, 5, 0, 0, 0, 0, V, I, I, 5}, {1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1}, 3, {1, 2, 2, 1, 2, 4}, {},
                 {});
  EXPECT_EQ(r.deltas, (std::vector<int64_t>{3 + 1 - 4, 0, 3 + 1 - 4}));
  // row 2, W axis: vs 0, image 1 1 -> w 1, 2, then text 3
  EXPECT_EQ(slice(r.pos, 2 * 12 + 8, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  for (int a = 0; a < 3; ++a)
    for (int l = 4; l < 8; ++l) EXPECT_EQ(r.pos[a * 12 + l], 1);  // the all-padding row
}

TEST(RopeIndexCpu, Hf5RunsResumeAtMaxSideAndPadWithZero) {
  // [pad, t, <vs>, video x 4 (grid 2x4x2 -> 2 frames of 2x1), t, t], 1 s a grid, tps 2: interval 2
  Batch b;
  b.mode = RopeIndexMode::kHf5;
  b.ids = {0, 5, V, W, W, W, W, 5, 5};
  b.mask = {0, 1, 1, 1, 1, 1, 1, 1, 1};
  b.types = {0, 0, 0, 2, 2, 2, 2, 0, 0};
  b.vid = {2, 4, 2};
  Result r = run_cpu(b);
  // text 0, 1; the video at st = 2: T = 2 + {0, 0, 2, 2}, H = 2 + {0, 1, 0, 1}, W = 2; text resumes
  // at 2 + max(2, 1) = 4 (below the video's T maximum 4: the reference's overlap)
  EXPECT_EQ(r.pos, (std::vector<int64_t>{0, 0, 1, 2, 2, 4, 4, 4, 5,  //
                                         0, 0, 1, 2, 3, 2, 3, 4, 5,  //
                                         0, 0, 1, 2, 2, 2, 2, 4, 5}));
  EXPECT_EQ(r.deltas, (std::vector<int64_t>{5 + 1 - 8}));
  b.types = {0, 0, 0, 2, 2, 2, 0, 0, 0};  // a run of 3 for a grid of 4 tokens
  expect_error([&] { run_cpu(b); }, "the video run at token 2 has 3 tokens but its grid (2 x 2 x 1) has 4");
}

TEST(RopeIndexCpu, BadInputNamesTheProblem) {
  expect_error([] { run({V, I, V, I}, {}, 1, {1, 2, 2}, {}, {}); }, "more image spans than image_grid_thw rows (1)");
  expect_error([] { run({V, I, I}, {}, 1, {1, 4, 4}, {}, {}); }, "has only 2 valid tokens left");
  expect_error([] { run({V, I, 5}, {}, 1, {1, 3, 2}, {}, {}); }, "divisible by spatial_merge_size 2");
  expect_error([] { run({5, V}, {}, 1, {1, 2, 2}, {}, {}); }, "vision start token is the last valid token");
  expect_error([] { run({V, I, I, 5, 5}, {}, 1, {1, 2, 6}, {}, {}); }, "token 3 is not an image token");
  expect_error([] { run({V, W, 5}, {}, 1, {}, {1, 2, 2}, {1.0f, 2.0f}); }, "second_per_grid_ts: expected shape [1]");
  expect_error([] { run({V, W, 5}, {}, 1, {}, {1, 2, 2}, {}, RopeIndexMode::kHf5); }, "mode hf5 needs mm_token_type_ids");
}

namespace {

struct Vision {
  std::vector<int64_t> grid;
  int m = 2, ws = 4;
  VisionGridSizes s;
  std::vector<int64_t> idx, rev, pos;
  std::vector<int32_t> cu, cus;
  std::vector<float> ang;
  TensorView gv() { return host_view(grid.data(), DType::kInt64, {int64_t(grid.size()) / 3, 3}); }
  void run_cpu(const std::vector<float>& inv_freq) {
    s = vision_grid_sizes(gv(), m, ws);
    idx.assign(s.tokens, -99);
    rev.assign(s.tokens, -99);
    cu.assign(s.windows + 1, -99);
    cus.assign(s.frames + 1, -99);
    pos.assign(2 * s.patches, -99);
    ang.assign(s.patches * 2 * inv_freq.size(), -99.0f);
    TensorView iv = host_view(idx.data(), DType::kInt64, {s.tokens}), rv = host_view(rev.data(), DType::kInt64, {s.tokens});
    TensorView cv = host_view(cu.data(), DType::kInt32, {s.windows + 1}), sv = host_view(cus.data(), DType::kInt32, {s.frames + 1});
    TensorView pv = host_view(pos.data(), DType::kInt64, {s.patches, 2});
    TensorView av = host_view(ang.data(), DType::kFloat32, {s.patches, int64_t(2 * inv_freq.size())});
    TensorView fv = host_view(const_cast<float*>(inv_freq.data()), DType::kFloat32, {int64_t(inv_freq.size())});
    TensorView none;
    window_index(gv(), m, ws, s, iv, rv, cv, sv, none, nullptr);
    vision_positions(gv(), m, s, fv, pv, av, none, nullptr);
  }
};

}  // namespace

TEST(VisionCpu, HandWorkedWindowsPartialAndExact) {
  // grid A: 1 x (6/2=3) x (10/2=5) merged, ws = 112/2/14 = 4 -> windows 1 x 2 (partial col, rows);
  // grid B: 2 frames x (8/2=4) x (8/2=4): exactly one window a frame (HF's empty pad windows removed)
  Vision v;
  v.grid = {1, 6, 10, 2, 8, 8};
  v.ws = window_side(2, 112, 14);
  ASSERT_EQ(v.ws, 4);
  v.run_cpu({1.0f});
  EXPECT_EQ(v.s.tokens, 15 + 32);
  EXPECT_EQ(v.s.windows, 2 + 2);
  EXPECT_EQ(v.s.max_seqlen, 64);
  EXPECT_EQ(v.s.max_window_seqlen, 64);
  // grid A (3 x 5, row-major ids 0..14): window (0,0) rows 0-2 cols 0-3; (0,1) rows 0-2 col 4
  std::vector<int64_t> a = {0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 4, 9, 14};
  EXPECT_EQ(slice(v.idx, 0, 15), a);
  for (int64_t i = 15; i < 47; ++i) EXPECT_EQ(v.idx[i], i);  // grid B: one window a frame, in order
  for (int64_t k = 0; k < 47; ++k) EXPECT_EQ(v.rev[v.idx[k]], k);
  // patches a window: A (0,0) 3 x 4 merged = 48, A (0,1) 3 x 1 = 12; B 16 merged = 64 a frame
  EXPECT_EQ(v.cu, (std::vector<int32_t>{0, 48, 60, 124, 188}));
  EXPECT_EQ(v.cus, (std::vector<int32_t>{0, 60, 124, 188}));
}

TEST(VisionCpu, HandWorkedPatchPositions) {
  // one frame of 2 x 4 patches, merge 2: blocks (0,0) then (0,1), patches row-major inside a block
  Vision v;
  v.grid = {1, 2, 4};
  v.run_cpu({0.5f, 3.0f});
  EXPECT_EQ(v.pos, (std::vector<int64_t>{0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3}));
  // patch 5 = (row 0, col 3): [0 * f | 3 * f]
  EXPECT_EQ(std::vector<float>(v.ang.begin() + 5 * 4, v.ang.begin() + 6 * 4), (std::vector<float>{0.0f, 0.0f, 1.5f, 9.0f}));
  v.grid = {1, 3, 4};
  expect_error([&] { v.run_cpu({1.0f}); }, "divisible by spatial_merge_size 2");
}

#ifdef MMFUSE_WITH_CUDA
namespace {

// A random batch: rows of text runs, images and videos (random grids, several per row), left or
// right padding, sometimes all padding; grids listed in order across the batch.
Batch random_batch(std::mt19937_64& rng, RopeIndexMode mode, int64_t B, int64_t L) {
  Batch b;
  b.B = B;
  b.mode = mode;
  auto U = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const int m = 2;
  for (int64_t r = 0; r < B; ++r) {
    std::vector<int64_t> ids, types;
    const int64_t budget = U(0, 3) == 0 ? 0 : U(L / 2, L);
    while (int64_t(ids.size()) < budget) {
      const int64_t n_text = U(0, 12);
      for (int64_t i = 0; i < n_text; ++i) {
        ids.push_back(U(10, 99));
        types.push_back(0);
      }
      const bool video = U(0, 2) == 0;
      const int64_t t = video ? U(1, 5) : 1, h = m * U(1, 9), w = m * U(1, 31);
      const int64_t len = t * (h / m) * (w / m);
      if (int64_t(ids.size()) + len + 2 > budget) break;
      ids.push_back(V);
      types.push_back(0);
      for (int64_t i = 0; i < len; ++i) {
        ids.push_back(video ? W : I);
        types.push_back(video ? 2 : 1);
      }
      (video ? b.vid : b.img).insert((video ? b.vid : b.img).end(), {t, h, w});
      if (video) b.sec.push_back(std::vector<float>{0.083f, 0.5f, 1.0f, 1.5f, 2.0f}[U(0, 4)]);
    }
    const int64_t n = int64_t(ids.size()), padl = U(0, 1) ? L - n : 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t k = l - padl;
      const bool in = k >= 0 && k < n;
      b.ids.push_back(in ? ids[k] : 0);
      b.types.push_back(in ? types[k] : 0);
      b.mask.push_back(in ? 1 : 0);
    }
  }
  if (b.vid.empty()) b.sec.clear();
  return b;
}

Result run_cuda(Batch& b) {
  DeviceBuffer<int64_t> ids(b.ids), mask(b.mask), types(b.types), img(b.img), vid(b.vid);
  DeviceBuffer<float> sec(b.sec);
  DeviceBuffer<int64_t> pos(3 * b.B * b.L()), deltas(b.B);
  DeviceBuffer<int32_t> ws(rope_index_workspace_size(b.B));
  pos.poison();
  deltas.poison();
  const Device dev{DeviceType::kCUDA, 0};
  RopeIndexInputs in = inputs_of(b, dev, {ids.ptr, mask.ptr, types.ptr, img.ptr, vid.ptr, sec.ptr});
  TensorView tp = device_view(pos.ptr, DType::kInt64, {3, b.B, b.L()});
  TensorView td = device_view(deltas.ptr, DType::kInt64, {b.B, 1});
  TensorView tw = device_view(ws.ptr, DType::kInt32, {rope_index_workspace_size(b.B)});
  rope_index(in, params_of(b), tp, td, tw, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {pos.download(), deltas.download()};
}

}  // namespace

TEST(RopeIndexCuda, EqualsCpuOnRandomBatches) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  int cases = 0;
  for (RopeIndexMode mode : {RopeIndexMode::kQwen, RopeIndexMode::kHf4, RopeIndexMode::kHf5})
    for (auto [B, L] : {std::pair<int64_t, int64_t>{1, 7}, {3, 300}, {4, 2500}, {2, 9000}, {8, 4097}}) {
      Batch b = random_batch(rng, mode, B, L);
      if (cases % 3 == 1) b.mask.clear();  // no mask: every row full length
      if (cases % 3 == 1)
        for (auto& x : b.ids) x = x == 0 ? 5 : x;
      const Result want = run_cpu(b), got = run_cuda(b);
      EXPECT_EQ(got.pos, want.pos) << "mode " << int(mode) << " B " << B << " L " << L;
      EXPECT_EQ(got.deltas, want.deltas) << "mode " << int(mode) << " B " << B << " L " << L;
      ++cases;
    }
}

TEST(VisionCuda, EqualsCpuWithThousandsOfWindows) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  Vision v;
  for (int i = 0; i < 120; ++i) {  // merged widths 41, 47, 55, 61, 121 and sizes dividing the window
    const int64_t width[] = {41, 47, 55, 61, 121, 4, 8, 16, 3, 1}, height[] = {1, 3, 4, 8, 16, 5, 12};
    v.grid.insert(v.grid.end(), {std::uniform_int_distribution<int64_t>(1, 3)(rng), 2 * height[i % 7],
                                 2 * width[i % 10]});
  }
  std::vector<float> inv_freq = random_vec<float>(20, rng, 0.0, 1.0);
  v.run_cpu(inv_freq);
  ASSERT_GT(v.s.windows, 1000);
  DeviceBuffer<int64_t> grid(v.grid), idx(v.s.tokens), rev(v.s.tokens), pos(2 * v.s.patches), ws(vision_workspace_size(v.s.grids));
  DeviceBuffer<int32_t> cu(v.s.windows + 1), cus(v.s.frames + 1);
  DeviceBuffer<float> fr(inv_freq), ang(v.s.patches * 40);
  for (auto* p : {&idx, &rev, &pos}) p->poison();
  cu.poison();
  cus.poison();
  ang.poison();
  TensorView gv = device_view(grid.ptr, DType::kInt64, {v.s.grids, 3}), wv = device_view(ws.ptr, DType::kInt64, {vision_workspace_size(v.s.grids)});
  TensorView iv = device_view(idx.ptr, DType::kInt64, {v.s.tokens}), rv = device_view(rev.ptr, DType::kInt64, {v.s.tokens});
  TensorView cv = device_view(cu.ptr, DType::kInt32, {v.s.windows + 1}), sv = device_view(cus.ptr, DType::kInt32, {v.s.frames + 1});
  TensorView pv = device_view(pos.ptr, DType::kInt64, {v.s.patches, 2}), av = device_view(ang.ptr, DType::kFloat32, {v.s.patches, 40});
  TensorView fv = device_view(fr.ptr, DType::kFloat32, {20});
  window_index(gv, v.m, v.ws, v.s, iv, rv, cv, sv, wv, nullptr);
  vision_positions(gv, v.m, v.s, fv, pv, av, wv, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(idx.download(), v.idx);
  EXPECT_EQ(rev.download(), v.rev);
  EXPECT_EQ(cu.download(), v.cu);
  EXPECT_EQ(cus.download(), v.cus);
  EXPECT_EQ(pos.download(), v.pos);
  const std::vector<float> a = ang.download();
  ASSERT_EQ(a.size(), v.ang.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(bits_equal(a[i], v.ang[i])) << i;
}
#endif
