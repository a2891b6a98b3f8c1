// Dual-expert GEMM on the CPU against a float64 reference: all four layouts, m in {0, 1, 7, 128},
// odd and aligned n and k, bf16 / fp16 / fp32 inputs, outputs in the input dtype or fp32,
// accumulation into fp32; bad input names the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda/dual_gemm_sm90_schedule.h"
#include "mmfuse/dual_gemm.h"
#include "test_util.h"
#ifdef MMFUSE_WITH_CUDA
#include "cuda/dual_gemm_sm90.h"
#endif

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

struct Expert {
  int64_t m, n, k;
};

// Where a check runs: the CPU, the CUDA entry point (whichever path it picks), or the persistent
// sm_90a kernel called directly.
enum class Run { kCpu, kCuda, kPersistent };

// Runs dual_gemm on the host views (on the GPU: through device copies, outputs poisoned there
// unless accumulating).
template <class S, class O>
void run_dual(TensorView (&av)[2], TensorView (&wv)[2], TensorView (&ov)[2], std::vector<S> (&a)[2],
              std::vector<S> (&w)[2], std::vector<O> (&out)[2], const DualGemmOptions& opt, Run run) {
  TensorView none;
  if (run == Run::kCpu) return dual_gemm(av[0], wv[0], ov[0], av[1], wv[1], ov[1], opt, none, nullptr);
#ifdef MMFUSE_WITH_CUDA
  DeviceBuffer<S> da0(a[0]), da1(a[1]), dw0(w[0]), dw1(w[1]);
  DeviceBuffer<O> do0(out[0]), do1(out[1]);
  if (!opt.accumulate) {
    do0.poison();
    do1.poison();
  }
  DeviceBuffer<uint8_t> ws{static_cast<size_t>(dual_gemm_workspace_bytes())};
  auto dv = [](const TensorView& h, void* p) {
    TensorView v = h;
    v.data = p;
    v.device = Device{DeviceType::kCUDA, 0};
    return v;
  };
  TensorView ca[2] = {dv(av[0], da0.ptr), dv(av[1], da1.ptr)}, cw[2] = {dv(wv[0], dw0.ptr), dv(wv[1], dw1.ptr)};
  TensorView co[2] = {dv(ov[0], do0.ptr), dv(ov[1], do1.ptr)};
  TensorView cws = device_view(ws.ptr, DType::kUInt8, {int64_t(ws.n)});
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  if (run == Run::kPersistent) {
    auto k_of = [&](const TensorView& x) { return opt.trans_a ? x.shape[0] : x.shape[1]; };
    const detail::Sm90Expert ex[2] = {{&ca[0], &cw[0], &co[0], co[0].shape[0], co[0].shape[1], k_of(ca[0])},
                                      {&ca[1], &cw[1], &co[1], co[1].shape[0], co[1].shape[1], k_of(ca[1])}};
    detail::sm90_dual_gemm(ex, opt, cws, s);
  } else {
    dual_gemm(ca[0], cw[0], co[0], ca[1], cw[1], co[1], opt, cws, s);
  }
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaStreamDestroy(s);
  out[0] = do0.download();
  out[1] = do1.download();
#else
  FAIL() << "no CUDA in this build";
#endif
}

// Checks one random dual problem of input type S and output type O against float64.
template <class S, class O>
void check_dual(std::mt19937_64& rng, Expert e0, Expert e1, bool ta, bool tb, bool accumulate, Run run = Run::kCpu) {
  const Expert es[2] = {e0, e1};
  std::vector<S> a[2], w[2];
  std::vector<O> out[2], before[2];
  TensorView av[2], wv[2], ov[2];
  for (int e = 0; e < 2; ++e) {
    const auto [m, n, k] = es[e];
    a[e] = random_vec<S>(m * k, rng);
    w[e] = random_vec<S>(k * n, rng);
    out[e] = random_vec<O>(m * n, rng);
    if (!accumulate) poison(out[e]);
    before[e] = out[e];
    av[e] = host_view(a[e].data(), dtype_of<S>(), ta ? std::vector<int64_t>{k, m} : std::vector<int64_t>{m, k});
    wv[e] = host_view(w[e].data(), dtype_of<S>(), tb ? std::vector<int64_t>{n, k} : std::vector<int64_t>{k, n});
    ov[e] = host_view(out[e].data(), dtype_of<O>(), {m, n});
  }
  DualGemmOptions opt;
  opt.trans_a = ta;
  opt.trans_b = tb;
  opt.accumulate = accumulate;
  run_dual(av, wv, ov, a, w, out, opt, run);
  const double out_eps = std::is_same_v<O, bf16> ? 1.0 / 256 : std::is_same_v<O, f16> ? 1.0 / 2048 : 1e-7;
  for (int e = 0; e < 2; ++e) {
    const auto [m, n, k] = es[e];
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double ref = accumulate ? as_double(before[e][i * n + j]) : 0.0, mag = std::abs(ref);
        for (int64_t kk = 0; kk < k; ++kk) {
          const double x = as_double(a[e][ta ? kk * m + i : i * k + kk]), y = as_double(w[e][tb ? j * k + kk : kk * n + j]);
          ref += x * y;
          mag += std::abs(x * y);
        }
        // fp32 accumulation of k products (and the sum with the old value), then one output rounding
        const double tol = double(k + 2) * std::ldexp(1.0, -23) * mag + out_eps * std::abs(ref) + 1e-30;
        const double got = as_double(out[e][i * n + j]);
        ASSERT_LE(std::abs(got - ref), tol) << (run == Run::kCpu ? "CPU " : run == Run::kCuda ? "CUDA " : "persistent ") << "expert " << e << " (" << m << "x" << n << "x" << k << ") ta " << ta
                                            << " tb " << tb << " acc " << accumulate << " at " << i << "," << j;
      }
  }
}

}  // namespace

TEST(DualGemmCpu, AllLayoutsAgainstFloat64) {
  std::mt19937_64 rng(test_seed());
  const Expert shapes[][2] = {{{7, 33, 19}, {1, 8, 64}},   {{128, 64, 40}, {0, 24, 17}},
                              {{0, 5, 3}, {128, 17, 64}},  {{1, 1, 1}, {7, 130, 5}},
                              {{16, 48, 0}, {3, 9, 11}}};
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const auto& s : shapes) {
        check_dual<bf16, bf16>(rng, s[0], s[1], ta, tb, false);
        check_dual<bf16, float>(rng, s[0], s[1], ta, tb, false);
        check_dual<bf16, float>(rng, s[0], s[1], ta, tb, true);
        check_dual<f16, f16>(rng, s[0], s[1], ta, tb, false);
        check_dual<float, float>(rng, s[0], s[1], ta, tb, true);
      }
}

TEST(DualGemmCpu, BadInputNamesTheProblem) {
  std::vector<bf16> a(6 * 4), w(4 * 5), out(6 * 5), wide(6 * 10);
  std::vector<float> outf(6 * 5);
  TensorView ws;
  TensorView a0 = host_view(a.data(), DType::kBFloat16, {6, 4}), w0 = host_view(w.data(), DType::kBFloat16, {4, 5});
  TensorView o0 = host_view(out.data(), DType::kBFloat16, {6, 5}), of = host_view(outf.data(), DType::kFloat32, {6, 5});
  DualGemmOptions opt;
  expect_error([&] { dual_gemm(a0, w0, o0, a0, host_view(w.data(), DType::kBFloat16, {5, 4}), o0, opt, ws, nullptr); },
               "w1: expected 4 along its k dim (that of a1; trans_a=False, trans_b=False), got shape [5, 4]");
  TensorView o_t = host_view(out.data(), DType::kBFloat16, {5, 6});
  expect_error([&] { dual_gemm(a0, w0, o0, a0, w0, o_t, opt, ws, nullptr); },
               "out1: expected shape [6, 5], got [5, 6]");
  TensorView strided = host_view(wide.data(), DType::kBFloat16, {6, 5}, {10, 1});
  expect_error([&] { dual_gemm(a0, w0, strided, a0, w0, o0, opt, ws, nullptr); },
               "out0: expected a contiguous tensor (outputs are written in place), got strides [10, 1]");
  opt.accumulate = true;
  expect_error([&] { dual_gemm(a0, w0, of, a0, w0, o0, opt, ws, nullptr); },
               "out1: accumulate=True needs a float32 output, got bfloat16");
  opt.accumulate = false;
  expect_error([&] { dual_gemm(a0, w0, o0, host_view(outf.data(), DType::kFloat32, {6, 4}), w0, o0, opt, ws, nullptr); },
               "a1: expected dtype bfloat16 (that of a0), got float32");
  TensorView cuda_a = a0;
  cuda_a.device = Device{DeviceType::kCUDA, 0};
  expect_error([&] { dual_gemm(cuda_a, w0, o0, a0, w0, o0, opt, ws, nullptr); },
               "w0: expected a tensor on cuda:0 (that of a0), got cpu");
}

// The persistent kernel's schedules (plain host code, checked without a GPU): every k-block of every
// unit runs exactly once; whole units (round robin) come first. Every spilled slot is written once,
// and each gathering segment adds exactly its unit's other segments, in k order, up to its own
// first k-block. Run to completion, clusters each walking their segments in order and a gather
// waiting until its slots are written, no cluster is left waiting (no deadlock while all are
// resident). Stream-K: the same number of whole units on every cluster (a multiple of G in all), a
// share of at most ceil(R / G) of the remaining R k-blocks, from its end back; only the share's
// segment run first spills and only the one run last gathers, from clusters of lower index only.
TEST(DualGemmSchedule, EveryKBlockOnceAndEverySplitGathered) {
  using namespace mmfuse::detail;
  std::mt19937_64 rng(test_seed());
  const size_t plenty = size_t(1) << 40;
  for (int trial = 0; trial < 600; ++trial) {
    auto pick = [&](int lo, int hi) { return lo + int(rng() % uint64_t(hi - lo + 1)); };
    const bool many = trial % 3 == 0;  // several waves: whole units first
    const int units[2] = {pick(0, many ? 600 : 150), pick(0, 40)}, kblocks[2] = {pick(1, 180), pick(1, 180)};
    const int max_clusters = std::vector<int>{1, 2, 7, 66, 132}[trial % 5];
    if (units[0] + units[1] == 0) continue;
    for (int mode : {kScheduleTiles, kScheduleStreamK}) {
      const Schedule s = make_schedule(units, kblocks, max_clusters, mode, plenty);
      const std::string where = "units " + std::to_string(units[0]) + "/" + std::to_string(units[1]) + " kblocks " +
                                std::to_string(kblocks[0]) + "/" + std::to_string(kblocks[1]) + " clusters " +
                                std::to_string(max_clusters) + " mode " + std::to_string(mode);
      ASSERT_EQ(s.kind, mode) << where;  // (plenty of workspace: what is asked for)
      ASSERT_GE(s.clusters, 1) << where;
      ASSERT_LE(s.clusters, max_clusters) << where;
      ASSERT_EQ(s.iters, (long long)units[0] * kblocks[0] + (long long)units[1] * kblocks[1]) << where;
      if (s.kind == kScheduleStreamK) {
        ASSERT_EQ(s.dp_units % s.clusters, 0) << where;
      } else {
        ASSERT_EQ(s.dp_units, s.total_units) << where;
        ASSERT_EQ(s.slots, 0) << where;
      }
      if (s.kind == kScheduleStreamK) ASSERT_LE(s.clusters, s.iters - s.dp_iters) << where;
      std::vector<std::vector<int>> runs(size_t(s.total_units));
      for (int u = 0; u < s.total_units; ++u) runs[size_t(u)].assign(size_t(s.kblocks[u >= units[0]]), 0);
      std::vector<std::vector<Segment>> segs(size_t(s.clusters));
      std::vector<size_t> whole(size_t(s.clusters), 0);  // segments of whole units run round robin
      for (int g = 0; g < s.clusters; ++g) {
        Walk w = walk_start(s, g);
        Segment seg;
        long long share = 0;
        while (next_segment(s, w, seg)) {
          ASSERT_LT(seg.kb_begin, seg.kb_end) << where;
          for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb) ++runs.at(size_t(seg.u)).at(size_t(kb));
          if (seg.u < s.dp_units) {
            ASSERT_EQ(whole[size_t(g)], segs[size_t(g)].size()) << where << ": whole units come first";
            ASSERT_EQ(seg.u % s.clusters, g) << where;
            ++whole[size_t(g)];
          } else {
            if (s.kind == kScheduleStreamK && segs[size_t(g)].size() > whole[size_t(g)])
              ASSERT_LT(seg.u, segs[size_t(g)].back().u) << where << ": the share runs from its end back";
            share += seg.kb_end - seg.kb_begin;
          }
          segs[size_t(g)].push_back(seg);
        }
        if (s.kind == kScheduleStreamK) {
          ASSERT_EQ(whole[size_t(g)], size_t(s.dp_units / s.clusters)) << where;
          ASSERT_LE(share, (s.iters - s.dp_iters + s.clusters - 1) / s.clusters) << where << " cluster " << g;
        }
      }
      for (const auto& r : runs)
        for (int n : r) ASSERT_EQ(n, 1) << where;
      std::map<int, Segment> spilled;  // slot -> the segment that writes it
      for (int g = 0; g < s.clusters; ++g)
        for (size_t i = 0; i < segs[size_t(g)].size(); ++i) {
          const Segment& seg = segs[size_t(g)][i];
          const int kbs = s.kblocks[seg.u >= units[0]];
          const bool sk = s.kind == kScheduleStreamK;
          ASSERT_EQ(seg.spill, sk && seg.kb_end < kbs) << where;
          ASSERT_EQ(seg.gather, sk && seg.kb_begin > 0 && seg.kb_end == kbs) << where;
          if (seg.spill) {
            ASSERT_GE(seg.slot, 0) << where;
            ASSERT_LT(seg.slot, s.slots) << where;
            ASSERT_EQ(spilled.count(seg.slot), 0u) << where << ": slot " << seg.slot << " written twice";
            spilled[seg.slot] = seg;
            ASSERT_EQ(i, whole[size_t(g)]) << where;
          }
          if (seg.gather) ASSERT_EQ(i + 1, segs[size_t(g)].size()) << where;
        }
      size_t gathered = 0;
      for (int g = 0; g < s.clusters; ++g)
        for (const Segment& seg : segs[size_t(g)]) {
          if (!seg.gather) continue;
          ASSERT_GE(seg.partials, 1) << where;
          ASSERT_EQ(seg.slot + seg.partials, g) << where << ": a cluster waits only on clusters of lower index";
          int next_kb = 0;
          for (int h = 0; h < seg.partials; ++h) {
            const int slot = seg.slot + h;
            ASSERT_TRUE(spilled.count(slot)) << where << " slot " << slot;
            const Segment& part = spilled[slot];
            ASSERT_EQ(part.u, seg.u) << where;
            ASSERT_EQ(part.kb_begin, next_kb) << where;
            next_kb = part.kb_end;
            ++gathered;
          }
          ASSERT_EQ(next_kb, seg.kb_begin) << where;
        }
      ASSERT_EQ(gathered, spilled.size()) << where;
      // run it: each round, every cluster goes on until a gather whose slots are not all written
      std::vector<size_t> at(size_t(s.clusters), 0);
      std::vector<bool> written(size_t(s.slots), false);
      for (bool moved = true; moved;) {
        moved = false;
        for (int g = 0; g < s.clusters; ++g) {
          auto& list = segs[size_t(g)];
          while (at[size_t(g)] < list.size()) {
            const Segment& seg = list[at[size_t(g)]];
            bool ready = true;
            for (int h = 0; h < seg.partials; ++h) ready = ready && written[size_t(seg.slot + h)];
            if (!ready) break;
            if (seg.spill) written[size_t(seg.slot)] = true;
            ++at[size_t(g)];
            moved = true;
          }
        }
      }
      for (int g = 0; g < s.clusters; ++g)
        ASSERT_EQ(at[size_t(g)], segs[size_t(g)].size()) << where << ": cluster " << g << " waits forever";
    }
  }
}

// Which schedule auto takes, and the workspace it needs.
TEST(DualGemmSchedule, AutoAndWorkspace) {
  using namespace mmfuse::detail;
  const size_t ws = size_t(dual_gemm_workspace_bytes());
  ASSERT_LE(schedule_workspace_bytes(66), ws);  // H100 / H200: 132 SMs, 66 clusters of two
  // tiny-small dX on 66 clusters: 32 units of 172 k-blocks and 8 of 43 leave 26 clusters idle
  const Schedule dx = make_schedule({32, 8}, {172, 43}, 66, kScheduleAuto, ws);
  EXPECT_EQ(dx.kind, kScheduleStreamK);
  EXPECT_EQ(dx.clusters, 66);
  // tiny-small fwd: 172 + 11 units of 32 k-blocks; stream-K would cut the busiest cluster from 96 to
  // 89 k-blocks, but its units are short (measured slower there): tiles
  const Schedule fwd = make_schedule({172, 11}, {32, 32}, 66, kScheduleAuto, ws);
  EXPECT_EQ(fwd.kind, kScheduleTiles);
  EXPECT_EQ(make_schedule({172, 11}, {64, 64}, 66, kScheduleAuto, ws).kind, kScheduleStreamK);
  // three whole waves of equal units: nothing to gain from a split
  const Schedule even = make_schedule({198, 0}, {32, 1}, 66, kScheduleAuto, ws);
  EXPECT_EQ(even.kind, kScheduleTiles);
  EXPECT_EQ(even.clusters, 66);
  // the large forward, 1376 + 44 units of 32 k-blocks: 21.5 waves, the first 20 whole
  const Schedule large = make_schedule({1376, 44}, {32, 32}, 66, kScheduleStreamK, ws);
  EXPECT_EQ(large.dp_units, 20 * 66);
  EXPECT_EQ(large.dp_iters, 20 * 66 * 32);
  // too small a workspace: whole tiles, even when stream-K is asked for
  const Schedule small = make_schedule({32, 8}, {172, 43}, 66, kScheduleStreamK, schedule_workspace_bytes(66) - 1);
  EXPECT_EQ(small.kind, kScheduleTiles);
  EXPECT_EQ(small.clusters, 40);
  // fewer k-blocks than clusters: one k-block a cluster
  const Schedule tiny = make_schedule({1, 2}, {3, 1}, 66, kScheduleStreamK, ws);
  EXPECT_EQ(tiny.clusters, 5);
}

#ifdef MMFUSE_WITH_CUDA
TEST(DualGemmCuda, AllLayoutsAgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  const Expert shapes[][2] = {{{7, 33, 19}, {1, 8, 64}},      {{128, 64, 40}, {0, 24, 17}},
                              {{1024, 512, 256}, {128, 136, 72}}, {{1, 1, 1}, {7, 130, 5}},
                              {{16, 48, 0}, {3, 9, 11}},      {{4096, 256, 128}, {1, 64, 2048}}};
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const auto& s : shapes) {
        check_dual<bf16, bf16>(rng, s[0], s[1], ta, tb, false, Run::kCuda);
        check_dual<bf16, float>(rng, s[0], s[1], ta, tb, true, Run::kCuda);
        check_dual<f16, f16>(rng, s[0], s[1], ta, tb, false, Run::kCuda);
        check_dual<float, float>(rng, s[0], s[1], ta, tb, false, Run::kCuda);
      }
}

// The persistent kernel itself, every layout, under each schedule (whole tiles; stream-K, whose
// shares here split a unit across up to 64 clusters): partial tiles in m, n and k, an empty expert,
// the costlier problem second (the schedule reorders them), several tiles a CTA, fp32 outputs and
// accumulation, both epilogues (TMA stores clipped at the output's edges; stores from registers).
// Its operands need 16-byte row strides: the stored rows' lengths are multiples of 8, and the
// remaining sizes are ragged where the layout allows it.
TEST(DualGemmCuda, PersistentKernelAgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  if (!detail::sm90_dual_gemm_supported(0)) GTEST_SKIP() << "not an sm_90 GPU, or no sm_90a code in this build";
  std::mt19937_64 rng(test_seed());
  const Expert aligned[][2] = {{{128, 256, 64}, {8, 8, 8}},          {{136, 264, 200}, {0, 24, 16}},
                               {{8, 16, 2048}, {264, 264, 256}},    {{264, 520, 72}, {128, 136, 72}},
                               {{200, 328, 40}, {72, 8, 24}},       {{136, 24, 4096}, {8, 8, 8}}};
  for (const char* schedule : {"tiles", "stream-k"}) {
    ScopedEnv sched("MMFUSE_DUAL_GEMM_SCHEDULE", schedule);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (const auto& s : aligned) {
          // 16-bit outputs with rows of 16-byte multiples: the TMA epilogue, and the register one forced
          for (const char* epilogue : {"auto", "registers"}) {
            ScopedEnv env("MMFUSE_DUAL_GEMM_EPILOGUE", epilogue);
            check_dual<bf16, bf16>(rng, s[0], s[1], ta, tb, false, Run::kPersistent);
            check_dual<f16, f16>(rng, s[0], s[1], ta, tb, false, Run::kPersistent);
          }
          check_dual<bf16, float>(rng, s[0], s[1], ta, tb, true, Run::kPersistent);
          check_dual<f16, float>(rng, s[0], s[1], ta, tb, false, Run::kPersistent);
        }
    // more work than clusters (81 + 1 pairs of tiles): CTAs run several units, the second problem's in the tail
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        check_dual<bf16, bf16>(rng, {2176, 2304, 16}, {8, 8, 32}, ta, tb, false, Run::kPersistent);
    // two waves of units on 66 clusters (H100 / H200): under stream-K the first runs whole, the
    // second's two k-blocks a unit are shared out and split
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        check_dual<bf16, bf16>(rng, {136, 33792, 72}, {8, 8, 8}, ta, tb, false, Run::kPersistent);
    // ragged m and n (a [m, k], w [n, k]: only k is a stored row length) and ragged k (a [k, m], w [k, n])
    const Expert ragged_mn[][2] = {{{7, 33, 64}, {1, 300, 24}}, {{131, 257, 136}, {65, 1, 8}}};
    const Expert ragged_k[][2] = {{{64, 72, 19}, {8, 256, 1}}, {{136, 264, 201}, {128, 8, 65}}};
    for (const auto& s : ragged_mn) {
      check_dual<bf16, bf16>(rng, s[0], s[1], false, true, false, Run::kPersistent);
      check_dual<bf16, float>(rng, s[0], s[1], false, true, true, Run::kPersistent);
    }
    for (const auto& s : ragged_k) {
      check_dual<bf16, bf16>(rng, s[0], s[1], true, false, false, Run::kPersistent);
      check_dual<f16, float>(rng, s[0], s[1], true, false, true, Run::kPersistent);
    }
  }
}
#endif
