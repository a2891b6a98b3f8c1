// MoE routing on the CPU against a float64 reference written independently (a stable sort of the
// flattened ids, gathers, weighted sums): K in {1, 2, 4, 8}, E in {2, 8, 64, 256}, dropping, empty
// experts, T = 0 and 1, odd H; bad expert ids.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/moe/path.h"
#include "mmfuse/moe.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

struct Plan {
  std::vector<int32_t> map, d2s;
  std::vector<int64_t> counts;
};

Plan plan(std::vector<int64_t> ids, int64_t T, int64_t K, int64_t E, int64_t num_out) {
  const int64_t n = num_out == 0 ? T * K : num_out;
  Plan p;
  p.map.assign(K * T, -99);
  p.d2s.assign(n, -99);
  p.counts.assign(E, -99);
  TensorView iv = host_view(ids.data(), DType::kInt64, {T, K});
  TensorView mv = host_view(p.map.data(), DType::kInt32, {K, T}), cv = host_view(p.counts.data(), DType::kInt64, {E}),
             dv = host_view(p.d2s.data(), DType::kInt32, {n});
  TensorView ws;
  moe_plan(iv, E, num_out, mv, cv, dv, ws, nullptr);
  return p;
}

std::vector<int32_t> sort_plan(std::vector<int64_t> ids, int64_t T, int64_t K, int64_t num_out) {
  std::vector<int32_t> map(K * T, -99);
  TensorView iv = host_view(ids.data(), DType::kInt64, {T, K}), mv = host_view(map.data(), DType::kInt32, {K, T});
  TensorView ws;
  moe_sort_plan(iv, num_out, mv, ws, nullptr);
  return map;
}

}  // namespace

TEST(MoeCpu, SortPlanEqualsTheCountingPlan) {
  std::mt19937_64 rng(test_seed());
  for (int64_t K : {1, 2, 8})
    for (int64_t E : {1, 5, 64, 4096})
      for (int64_t T : {1, 37, 1001}) {
        std::vector<int64_t> ids(T * K);
        for (auto& e : ids) e = std::uniform_int_distribution<int64_t>(0, E - 1)(rng);  // repeats within a token
        for (int64_t num_out : {int64_t(0), T * K / 2})
          ASSERT_EQ(sort_plan(ids, T, K, num_out), plan(ids, T, K, E, num_out).map)
              << "K " << K << " E " << E << " T " << T << " num_out " << num_out;
      }
  // ids past any expert count: the order is still ascending id, then t * K + k
  EXPECT_EQ(sort_plan({2147483647, 7, 5000, 7, 0, 1 << 20}, 3, 2, 0), (std::vector<int32_t>{5, 3, 0, 1, 2, 4}));
  EXPECT_EQ(sort_plan({2147483647, 7, 5000, 7, 0, 1 << 20}, 3, 2, 4), (std::vector<int32_t>{-1, 3, 0, 1, 2, -1}));
  for (int64_t bad : {int64_t(-1), int64_t(1) << 31}) {
    try {
      sort_plan({0, 1, bad, 2}, 2, 2, 0);
      FAIL() << "no error for id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("moe_sort_plan: indices[1][0] = " + std::to_string(bad) +
                                           ": expected an expert id in [0, 2^31)"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(MoeCpu, PlanPermuteUnpermuteAgainstReference) {
  std::mt19937_64 rng(test_seed());
  for (int64_t K : {1, 2, 4, 8})
    for (int64_t E : {2, 8, 64, 256})
      for (int64_t T : {0, 1, 37, 300}) {
        if (K > E) continue;
        const int64_t H = 13;  // odd
        std::vector<int64_t> ids(T * K);
        for (int64_t t = 0; t < T; ++t) {  // K distinct experts a token, skewed so some experts stay empty
          std::vector<int64_t> e(E);
          std::iota(e.begin(), e.end(), 0);
          std::shuffle(e.begin(), e.begin() + std::min<int64_t>(E, 2 * K + 1), rng);
          for (int64_t k = 0; k < K; ++k) ids[t * K + k] = e[k];
        }
        for (int64_t num_out : {int64_t(0), T * K * 3 / 4}) {
          const int64_t n = num_out == 0 ? T * K : num_out;
          const Plan p = plan(ids, T, K, E, num_out);
          // reference: stable sort of the flat indices by expert id; keep the first n
          std::vector<int64_t> order(T * K);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
          std::vector<int64_t> counts(E, 0);
          for (int64_t d = 0; d < T * K; ++d) {
            const int64_t i = order[d], t = i / K, k = i % K;
            ASSERT_EQ(p.map[k * T + t], d < n ? d : -1) << "K " << K << " E " << E << " T " << T;
            if (d < n) {
              ASSERT_EQ(p.d2s[d], i);
              ++counts[ids[i]];
            }
          }
          ASSERT_EQ(p.counts, counts);
          // permute, unpermute with probabilities, and the backward, in float64 (same k order: exact)
          std::vector<double> x = random_vec<double>(T * H, rng), probs = random_vec<double>(T * K, rng, 0.0, 1.0);
          std::vector<float> pf(probs.begin(), probs.end());
          std::vector<double> perm(n * H, -1.0), out(T * H, -1.0), dy(n * H, -1.0), dout = random_vec<double>(T * H, rng);
          std::vector<float> dprobs(T * K, -1.0f);
          TensorView xv = host_view(x.data(), DType::kFloat64, {T, H}), pv = host_view(perm.data(), DType::kFloat64, {n, H});
          TensorView mv = host_view(const_cast<int32_t*>(p.map.data()), DType::kInt32, {K, T});
          TensorView prv = host_view(pf.data(), DType::kFloat32, {T, K}), ov = host_view(out.data(), DType::kFloat64, {T, H});
          TensorView gv = host_view(dout.data(), DType::kFloat64, {T, H}), dyv = host_view(dy.data(), DType::kFloat64, {n, H});
          TensorView dpv = host_view(dprobs.data(), DType::kFloat32, {T, K});
          TensorView ws;
          moe_permute(xv, mv, pv, nullptr);
          moe_unpermute(pv, mv, prv, ov, nullptr);
          moe_unpermute_backward(gv, pv, mv, prv, dyv, dpv, ws, nullptr);
          for (int64_t d = 0; d < n; ++d)
            for (int64_t h = 0; h < H; ++h) ASSERT_EQ(perm[d * H + h], x[(order[d] / K) * H + h]);
          std::vector<double> want_dy(n * H, 0.0);
          for (int64_t t = 0; t < T; ++t) {
            for (int64_t h = 0; h < H; ++h) {
              double s = 0;
              for (int64_t k = 0; k < K; ++k) {
                const int64_t r = p.map[k * T + t];
                if (r >= 0) s += double(pf[t * K + k]) * perm[r * H + h];
              }
              ASSERT_EQ(out[t * H + h], s);
            }
            for (int64_t k = 0; k < K; ++k) {
              const int64_t r = p.map[k * T + t];
              double dot = 0;
              for (int64_t h = 0; h < H; ++h) {
                if (r >= 0) {
                  dot += dout[t * H + h] * perm[r * H + h];
                  want_dy[r * H + h] = double(pf[t * K + k]) * dout[t * H + h];
                }
              }
              ASSERT_EQ(dprobs[t * K + k], r >= 0 ? float(dot) : 0.0f);
            }
          }
          ASSERT_EQ(dy, want_dy);
        }
      }
}

TEST(MoeCpu, UnpermuteWithoutProbsSumsInFp32) {
  // K = 1 and no probabilities: weights 1 (the seed's K = 1 path ignored prob); bf16 rounded once
  std::vector<int64_t> ids = {1, 0, 1};
  const Plan p = plan(ids, 3, 1, 2, 0);
  EXPECT_EQ(p.map, (std::vector<int32_t>{1, 0, 2}));
  std::vector<bf16> y = {to_bf16(1.5f), to_bf16(-2.0f), to_bf16(3.25f)}, out(3);
  TensorView yv = host_view(y.data(), DType::kBFloat16, {3, 1}), ov = host_view(out.data(), DType::kBFloat16, {3, 1});
  TensorView mv = host_view(const_cast<int32_t*>(p.map.data()), DType::kInt32, {1, 3}), none;
  moe_unpermute(yv, mv, none, ov, nullptr);
  EXPECT_EQ(to_float(out[0]), -2.0f);
  EXPECT_EQ(to_float(out[1]), 1.5f);
  EXPECT_EQ(to_float(out[2]), 3.25f);
}

TEST(MoeCpu, BadInputNamesTheProblem) {
  try {
    plan({0, 3, 1, 2}, 2, 2, 3, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("indices[0][1] = 3: expected an expert id in [0, 3)"), std::string::npos)
        << e.what();
  }
  try {
    plan({0, 1}, 1, 2, 2, 5);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_out_tokens"), std::string::npos) << e.what();
  }
}

// The CUDA path rule (pure host functions), checked without a GPU.
TEST(MoePath, PlanLaunchAndHistograms) {
  using namespace detail::moe;
  // sm_90 at one tile a warp: the two kernels as dependent launches, even where the blocks fit at once
  PlanPath p = plan_path(90, 64, 512, 64, 264, true);
  EXPECT_FALSE(p.cooperative);
  EXPECT_TRUE(p.pdl);
  EXPECT_FALSE(p.narrow);
  // more tiles a warp: the cooperative kernel where its blocks fit, else the dependent launches
  EXPECT_TRUE(plan_path(90, 64, 2048, 64, 264, true).cooperative);
  p = plan_path(90, 64, 2048, 300, 264, true);
  EXPECT_FALSE(p.cooperative);
  EXPECT_TRUE(p.pdl);
  // before sm_90: cooperative where the blocks fit, else the two kernels in plain stream order
  EXPECT_TRUE(plan_path(80, 8, 512, 10, 216, true).cooperative);
  p = plan_path(80, 8, 512, 300, 216, true);
  EXPECT_FALSE(p.cooperative);
  EXPECT_FALSE(p.pdl);
  // 16-bit histograms from kPlanNarrowExperts experts, where a chunk's counts fit and the workspace is aligned
  EXPECT_FALSE(plan_path(90, kPlanNarrowExperts - 1, 512, 8, 264, true).narrow);
  EXPECT_TRUE(plan_path(90, kPlanNarrowExperts, 512, 8, 264, true).narrow);
  EXPECT_FALSE(plan_path(90, 4096, 0x10000, 8, 264, true).narrow);
  EXPECT_FALSE(plan_path(90, 4096, 512, 8, 264, false).narrow);
  // overrides
  EXPECT_TRUE(plan_path(90, 64, 512, 64, 264, true, PlanLaunch::kCooperative).cooperative);
  EXPECT_FALSE(plan_path(90, 64, 512, 300, 264, true, PlanLaunch::kCooperative).cooperative);  // cannot fit
  p = plan_path(90, 64, 2048, 64, 264, true, PlanLaunch::kTwo);
  EXPECT_FALSE(p.cooperative);
  EXPECT_FALSE(p.pdl);
  EXPECT_TRUE(plan_path(90, 8, 512, 8, 264, true, PlanLaunch::kAuto, PlanHist::kNarrow).narrow);
  EXPECT_FALSE(plan_path(90, 8, 512, 8, 264, false, PlanLaunch::kAuto, PlanHist::kNarrow).narrow);
  EXPECT_FALSE(plan_path(90, 4096, 512, 8, 264, true, PlanLaunch::kAuto, PlanHist::kWide).narrow);
}

TEST(MoePath, RowMovement) {
  using namespace detail::moe;
  EXPECT_EQ(permute_path(1).k_group, 1);
  EXPECT_FALSE(permute_path(2).streaming);
  EXPECT_EQ(permute_path(2).k_group, 2);
  EXPECT_TRUE(permute_path(4).streaming);
  // unpermute: a warp a token at K <= 2 (8 vectors a lane from 256 vectors a row at K = 1)
  EXPECT_EQ(unpermute_path(1, 255, true).kernel, UnpermuteKernel::kWarp);
  EXPECT_EQ(unpermute_path(1, 255, true).chunk, 4);
  EXPECT_EQ(unpermute_path(1, 256, true).chunk, 8);
  EXPECT_EQ(unpermute_path(0, 16, false).kernel, UnpermuteKernel::kWarp);
  EXPECT_EQ(unpermute_path(2, 512, true).k_group, 2);
  EXPECT_EQ(unpermute_path(2, 512, true).chunk, 4);
  EXPECT_EQ(unpermute_path(3, 512, true).kernel, UnpermuteKernel::kTile);
  EXPECT_EQ(unpermute_path(8, 512, false).kernel, UnpermuteKernel::kFlat);
  // backward
  const int64_t big = int64_t(1) << 30;
  EXPECT_EQ(unpermute_backward_path(100, 1, true), BwdKernel::kWarpToken);
  EXPECT_EQ(unpermute_backward_path(100, 2, true), BwdKernel::kWarpEntry);
  EXPECT_EQ(unpermute_backward_path(100, 8, true), BwdKernel::kTile);
  EXPECT_EQ(unpermute_backward_path(100, 8, false), BwdKernel::kWarpEntry);
  EXPECT_EQ(unpermute_backward_path(big, 2, false), BwdKernel::kGeneral);  // T * K = 2^31
  EXPECT_EQ(unpermute_backward_path(big, 2, true), BwdKernel::kTile);
  EXPECT_EQ(unpermute_backward_path(0, 0, false), BwdKernel::kGeneral);
  EXPECT_EQ(unpermute_backward_path(100, 8, true, BwdForce::kGeneral), BwdKernel::kGeneral);
  EXPECT_EQ(unpermute_backward_path(100, 8, false, BwdForce::kTile), BwdKernel::kGeneral);
  EXPECT_EQ(unpermute_backward_path(100, 1, true, BwdForce::kTile), BwdKernel::kTile);
  EXPECT_EQ(unpermute_backward_path(100, 8, true, BwdForce::kWarpEntry), BwdKernel::kWarpEntry);
  EXPECT_EQ(unpermute_backward_path(100, 8, true, BwdForce::kWarpToken), BwdKernel::kTile);  // K = 1 only
  EXPECT_EQ(unpermute_backward_path(100, 2, true, BwdForce::kWarpToken), BwdKernel::kWarpEntry);
}

TEST(MoePath, TileShape) {
  using namespace detail::moe;
  // unpermute, top-8 of 64 at H2048 bf16: a stage of 8 rows of 4 KB, 6 fit; one sequence, two producers
  TileShape s = tile_shape(90, 8, 1000, 4096, 8 * 4096, 1);
  EXPECT_EQ(s.stages, 6);
  EXPECT_EQ(s.seqs, 1);
  EXPECT_EQ(s.producers, 2);
  // backward without dprobs at H2048: 16 stages (the cap) in 8 sequences, two producers
  s = tile_shape(90, 4, 1000, 4096, 4096, kTileConsumers);
  EXPECT_EQ(s.stages, 16);
  EXPECT_EQ(s.seqs, 8);
  EXPECT_EQ(s.producers, 2);
  // three stages of 72 KB: three sequences of one stage, one producer
  s = tile_shape(90, 8, 1000, 8192, 9 * 8192, kTileConsumers);
  EXPECT_EQ(s.stages, 3);
  EXPECT_EQ(s.seqs, 3);
  EXPECT_EQ(s.producers, 1);
  EXPECT_EQ(tile_shape(80, 8, 1000, 4096, 8 * 4096, 1).stages, 0);           // sm_90+ only
  EXPECT_EQ(tile_shape(90, 9, 1000, 4096, 9 * 4096, 1).stages, 0);           // K > kTileMaxK
  EXPECT_EQ(tile_shape(90, 4, 1000, 4104, 4 * 4104, 1).stages, 0);           // rows not of 16-byte vectors
  EXPECT_EQ(tile_shape(90, 8, 1000, 16384, 8 * 16384, 1).stages, 0);         // fewer than two stages fit
  EXPECT_EQ(tile_shape(90, 4, 0, 4096, 4096, 1).stages, 0);                  // no tokens
}

#ifdef MMFUSE_WITH_CUDA
namespace {

// Random top-K routing: K distinct experts a token, skewed towards a few so some experts stay empty.
std::vector<int64_t> random_ids(std::mt19937_64& rng, int64_t T, int64_t K, int64_t E) {
  std::vector<int64_t> ids(T * K), e(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(e.begin(), e.end(), 0);
    const int64_t pool = std::min<int64_t>(E, std::uniform_int_distribution<int64_t>(K, 3 * K + 4)(rng));
    std::shuffle(e.begin(), e.begin() + pool, rng);
    for (int64_t k = 0; k < K; ++k) ids[t * K + k] = e[k];
  }
  return ids;
}

struct CudaPlan {
  std::vector<int32_t> map, d2s;
  std::vector<int64_t> counts;
};

// The CUDA plan of ids stored as dtype `it` (int32 / int64), optionally transposed ([K, T] storage
// read through strides), outputs poisoned first; the workspace `ws_offset` int32 into its buffer (not
// 16-byte aligned: the plan's int32 histograms instead of its 16-bit ones).
CudaPlan plan_cuda(const std::vector<int64_t>& ids, int64_t T, int64_t K, int64_t E, int64_t num_out, DType it,
                   bool transposed, cudaStream_t s, int64_t ws_offset = 0) {
  const int64_t n = num_out == 0 ? T * K : num_out;
  std::vector<int64_t> stored(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) stored[transposed ? k * T + t : t * K + k] = ids[t * K + k];
  std::vector<int32_t> stored32(stored.begin(), stored.end());
  DeviceBuffer<int64_t> i64(stored);
  DeviceBuffer<int32_t> i32(stored32), map(K * T), d2s(n), ws(moe_plan_workspace_size(T, K, E) + ws_offset);
  DeviceBuffer<int64_t> counts(E);
  map.poison();
  d2s.poison();
  counts.poison();
  ws.poison();
  void* p = it == DType::kInt64 ? static_cast<void*>(i64.ptr) : static_cast<void*>(i32.ptr);
  TensorView iv = transposed ? device_view(p, it, {T, K}, {1, T}) : device_view(p, it, {T, K});
  TensorView mv = device_view(map.ptr, DType::kInt32, {K, T}), cv = device_view(counts.ptr, DType::kInt64, {E});
  TensorView dv = device_view(d2s.ptr, DType::kInt32, {n});
  TensorView wv = device_view(ws.ptr + ws_offset, DType::kInt32, {int64_t(ws.n) - ws_offset});
  moe_plan(iv, E, num_out, mv, cv, dv, wv, s);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return {map.download(), d2s.download(), counts.download()};
}

}  // namespace

class MoeCudaPlan : public ::testing::TestWithParam<const char*> {};

// Every launch of the plan (MMFUSE_MOE_PLAN): auto (on sm_90+ the count and rank kernels with a
// programmatic dependent launch), the cooperative kernel (where its blocks fit), the two kernels in
// stream order.
INSTANTIATE_TEST_SUITE_P(PlanLaunches, MoeCudaPlan, ::testing::Values("auto", "cooperative", "two"));

TEST_P(MoeCudaPlan, PlanEqualsCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  ScopedOverride force("MMFUSE_MOE_PLAN", GetParam());
  std::mt19937_64 rng(test_seed());
  Stream st;
  int cases = 0;
  // The chunk histograms (MMFUSE_MOE_PLAN_HIST) in turn auto, wide (int32) and narrow (16-bit, at any
  // E; E = 37 and 384: rows of 5 and 48 16-byte groups), each with and without transposed ids; every
  // fourth case an unaligned workspace (int32 histograms), as is T = 300000 at E = 4096 (a chunk of
  // more than 2^16 entries).
  static const char* const kHist[] = {"auto", "wide", "narrow"};
  for (int64_t K : {1, 2, 4, 8})
    for (int64_t E : {1, 2, 8, 37, 64, 256, 384, 4096})
      for (int64_t T : {0, 1, 37, 3001, 70001, 300000}) {
        if (K > E || (T > 5000 && E == 4096 && K > 2) || (T > 100000 && (E != 4096 || K > 1))) continue;
        const std::vector<int64_t> ids = random_ids(rng, T, K, E);
        for (int64_t num_out : {int64_t(0), T * K * 3 / 4}) {
          if (T > 100000 && num_out) continue;
          const char* const hist_mode = kHist[(cases / 3) % 3];  // crossed with the transposed ids (cases % 3)
          ScopedOverride hist("MMFUSE_MOE_PLAN_HIST", hist_mode);
          const Plan want = plan(ids, T, K, E, num_out);
          const DType it = (cases % 2) ? DType::kInt32 : DType::kInt64;
          const CudaPlan got = plan_cuda(ids, T, K, E, num_out, it, cases % 3 == 0, st.s, cases % 4 == 1 ? 1 : 0);
          ASSERT_EQ(got.map, want.map) << "K " << K << " E " << E << " T " << T << " num_out " << num_out << " hist "
                                       << hist_mode;
          ASSERT_EQ(got.d2s, want.d2s) << "K " << K << " E " << E << " T " << T;
          ASSERT_EQ(got.counts, want.counts) << "K " << K << " E " << E << " T " << T;
          ++cases;
        }
      }
  EXPECT_GT(cases, 100);
}

namespace {

template <class S>
void rows_equal_cpu(std::mt19937_64& rng, int64_t T, int64_t K, int64_t E, int64_t H, int64_t num_out,
                    int64_t extra_rows, bool with_probs, cudaStream_t s) {
  const std::string where = "T " + std::to_string(T) + " K " + std::to_string(K) + " E " + std::to_string(E) +
                            " H " + std::to_string(H) + " num_out " + std::to_string(num_out);
  const std::vector<int64_t> ids = random_ids(rng, T, K, E);
  const Plan p = plan(ids, T, K, E, num_out);
  const int64_t n = num_out == 0 ? T * K : num_out, N = n + extra_rows;
  const DType dt = dtype_of<S>();
  std::vector<S> x = random_vec<S>(T * H, rng), dout = random_vec<S>(T * H, rng);
  std::vector<float> probs = random_vec<float>(T * K, rng, 0.0, 1.0);
  // CPU
  std::vector<S> perm(N * H), out(T * H), dy(N * H);
  std::vector<float> dprobs(T * K);
  poison(perm);
  poison(out);
  poison(dy);
  poison(dprobs);
  std::vector<S> perm_in = random_vec<S>(N * H, rng);  // y for unpermute: the permuted rows plus junk rows
  TensorView none, mv = host_view(const_cast<int32_t*>(p.map.data()), DType::kInt32, {K, T});
  TensorView xv = host_view(x.data(), dt, {T, H}), pv = host_view(perm.data(), dt, {N, H});
  TensorView yv = host_view(perm_in.data(), dt, {N, H}), ov = host_view(out.data(), dt, {T, H});
  TensorView gv = host_view(dout.data(), dt, {T, H}), dyv = host_view(dy.data(), dt, {N, H});
  TensorView prv = host_view(probs.data(), DType::kFloat32, {T, K}), dpv = host_view(dprobs.data(), DType::kFloat32, {T, K});
  moe_permute(xv, mv, pv, nullptr);
  moe_unpermute(yv, mv, with_probs ? prv : none, ov, nullptr);
  moe_unpermute_backward(gv, yv, mv, with_probs ? prv : none, dyv, dpv, none, nullptr);
  // CUDA
  DeviceBuffer<S> dx(x), dperm(N * H), dy_in(perm_in), dout_d(T * H), dg(dout), ddy(N * H);
  DeviceBuffer<int32_t> dmap(p.map), ws(moe_unpermute_backward_workspace_size(N));
  DeviceBuffer<float> dprob(probs), ddp(T * K);
  dperm.poison();
  dout_d.poison();
  ddy.poison();
  ddp.poison();
  ws.poison();
  TensorView cm = device_view(dmap.ptr, DType::kInt32, {K, T});
  TensorView cx = device_view(dx.ptr, dt, {T, H}), cp = device_view(dperm.ptr, dt, {N, H});
  TensorView cy = device_view(dy_in.ptr, dt, {N, H}), co = device_view(dout_d.ptr, dt, {T, H});
  TensorView cg = device_view(dg.ptr, dt, {T, H}), cdy = device_view(ddy.ptr, dt, {N, H});
  TensorView cpr = device_view(dprob.ptr, DType::kFloat32, {T, K}), cdp = device_view(ddp.ptr, DType::kFloat32, {T, K});
  TensorView cws = device_view(ws.ptr, DType::kInt32, {int64_t(ws.n)});
  moe_permute(cx, cm, cp, s);
  moe_unpermute(cy, cm, with_probs ? cpr : none, co, s);
  moe_unpermute_backward(cg, cy, cm, with_probs ? cpr : none, cdy, cdp, cws, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const std::vector<S> got_perm = dperm.download(), got_out = dout_d.download(), got_dy = ddy.download();
  const std::vector<float> got_dp = ddp.download();
  for (int64_t i = 0; i < n * H; ++i) ASSERT_TRUE(bits_equal(got_perm[i], perm[i])) << where << " permute " << i;
  for (int64_t i = 0; i < T * H; ++i) ASSERT_TRUE(bits_equal(got_out[i], out[i])) << where << " unpermute " << i;
  for (int64_t i = 0; i < N * H; ++i) ASSERT_TRUE(bits_equal(got_dy[i], dy[i])) << where << " dy " << i;
  for (int64_t i = 0; i < T * K; ++i)  // fp32 dots in another order: relative to the sum of |terms|
    ASSERT_NEAR(got_dp[i], dprobs[i], 1e-5 * (1.0 + 2.0 * 2.0 * double(H))) << where << " dprobs " << i;
  // the backward without dprobs (y is not read): the same dy
  ddy.poison();
  TensorView no_dp;
  moe_unpermute_backward(cg, cy, cm, with_probs ? cpr : none, cdy, no_dp, cws, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const std::vector<S> got_dy2 = ddy.download();
  for (int64_t i = 0; i < N * H; ++i) ASSERT_TRUE(bits_equal(got_dy2[i], dy[i])) << where << " dy, no dprobs " << i;
}

}  // namespace

class MoeCudaRows : public ::testing::TestWithParam<const char*> {};

// Every path of the backward (MMFUSE_MOE_BWD): auto (a warp a token at K = 1, a warp an entry at K = 2
// and where the tile kernel does not apply), the token-tile kernel, the general block kernel, a warp a
// token (K = 1), a warp an entry.
INSTANTIATE_TEST_SUITE_P(BackwardPaths, MoeCudaRows, ::testing::Values("auto", "tile", "general", "warp", "entry"));

TEST_P(MoeCudaRows, RowsEqualCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  ScopedOverride force("MMFUSE_MOE_BWD", GetParam());
  std::mt19937_64 rng(test_seed());
  Stream st;
  for (int64_t H : {1, 13, 64, 200, 2048})
    for (auto [T, K, E] : {std::tuple<int64_t, int64_t, int64_t>{0, 2, 8}, {1, 1, 2}, {37, 2, 8}, {300, 8, 64},
                           {513, 1, 2}, {129, 4, 256}, {45, 12, 64}}) {  // K = 12: past the tile and warp paths
      const int64_t keep = T * K * 3 / 4;
      rows_equal_cpu<bf16>(rng, T, K, E, H, 0, 0, true, st.s);
      rows_equal_cpu<bf16>(rng, T, K, E, H, keep, 5, true, st.s);  // dropping, and rows no entry maps to
      rows_equal_cpu<f16>(rng, T, K, E, H, 0, 0, false, st.s);
      rows_equal_cpu<float>(rng, T, K, E, H, keep, 0, true, st.s);
      rows_equal_cpu<double>(rng, T, K, E, H, 0, 3, true, st.s);
    }
  // many tokens a block: the token-tile paths' batches of 32 map reads and their stages wrapping around
  for (int64_t H : {64, 200})
    for (auto [T, K, E] : {std::tuple<int64_t, int64_t, int64_t>{70001, 1, 2}, {70001, 2, 8}, {40001, 8, 64}}) {
      rows_equal_cpu<bf16>(rng, T, K, E, H, T * K * 3 / 4, 5, true, st.s);
      rows_equal_cpu<float>(rng, T, K, E, H, 0, 0, false, st.s);
    }
}

// The plan without an expert count (a radix sort of the ids) against the CPU counting plan: int32 and
// int64 ids, transposed storage, dropping, and ids far past any expert count.
TEST(MoeCuda, SortPlanEqualsCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  Stream st;
  int cases = 0;
  for (int64_t K : {1, 2, 8})
    for (int64_t E : {1, 8, 64, 256, 4096})
      for (int64_t T : {1, 37, 3001, 70001}) {
        if (K > E || (T > 5000 && K > 2 && E != 64)) continue;
        std::vector<int64_t> ids = random_ids(rng, T, K, E);
        const bool sparse = cases % 5 == 4;  // ids spread over [0, 2^31): the sort's every digit in use
        if (sparse)
          for (auto& e : ids) e = e * 524287 + (e % 3) * 1009;  // below 2^31 up to e = 4095
        for (int64_t num_out : {int64_t(0), T * K * 3 / 4}) {
          const std::vector<int32_t> want = sort_plan(ids, T, K, num_out);
          if (!sparse) ASSERT_EQ(want, plan(ids, T, K, E, num_out).map);
          const DType it = (cases % 2) ? DType::kInt32 : DType::kInt64;
          const bool transposed = cases % 3 == 0;
          std::vector<int64_t> stored(T * K);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t k = 0; k < K; ++k) stored[transposed ? k * T + t : t * K + k] = ids[t * K + k];
          std::vector<int32_t> stored32(stored.begin(), stored.end());
          DeviceBuffer<int64_t> i64(stored);
          DeviceBuffer<int32_t> i32(stored32), map(K * T), ws(moe_sort_plan_workspace_size(T, K));
          map.poison();
          ws.poison();
          void* p = it == DType::kInt64 ? static_cast<void*>(i64.ptr) : static_cast<void*>(i32.ptr);
          TensorView iv = transposed ? device_view(p, it, {T, K}, {1, T}) : device_view(p, it, {T, K});
          TensorView mv = device_view(map.ptr, DType::kInt32, {K, T});
          TensorView wv = device_view(ws.ptr, DType::kInt32, {int64_t(ws.n)});
          moe_sort_plan(iv, num_out, mv, wv, st.s);
          ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
          ASSERT_EQ(map.download(), want) << "K " << K << " E " << E << " T " << T << " num_out " << num_out
                                          << (sparse ? " sparse ids" : "");
          ++cases;
        }
      }
  EXPECT_GT(cases, 40);
}

TEST(MoeCuda, PermutesFp8RowsAndIsDeterministic) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  Stream st;
  const int64_t T = 4099, K = 2, E = 8;
  const Plan p = plan(random_ids(rng, T, K, E), T, K, E, 0);
  DeviceBuffer<int32_t> dmap(p.map);
  for (int64_t H : {136, 144}) {  // H * 1 byte: 8-byte vectors, 16-byte vectors
    std::vector<uint8_t> x(T * H);
    for (auto& b : x) b = uint8_t(rng());
    DeviceBuffer<uint8_t> dx(x), dperm(T * K * H);
    dperm.poison();
    TensorView cx = device_view(dx.ptr, DType::kFloat8E4M3, {T, H});
    TensorView cp = device_view(dperm.ptr, DType::kFloat8E4M3, {T * K, H});
    moe_permute(cx, device_view(dmap.ptr, DType::kInt32, {K, T}), cp, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    const std::vector<uint8_t> got = dperm.download();
    for (int64_t d = 0; d < T * K; ++d)
      ASSERT_EQ(0, std::memcmp(&got[d * H], &x[(p.d2s[d] / K) * H], H)) << "H " << H << " row " << d;
  }
  // the backward's dprobs (block sums) are the same bits on every run
  const int64_t H2 = 4096;
  std::vector<bf16> y = random_vec<bf16>(T * K * H2, rng), g = random_vec<bf16>(T * H2, rng);
  std::vector<float> probs = random_vec<float>(T * K, rng, 0.0, 1.0);
  DeviceBuffer<bf16> dyin(y), dg(g), ddy(T * K * H2);
  DeviceBuffer<float> dp(probs), ddp(T * K);
  DeviceBuffer<int32_t> ws(moe_unpermute_backward_workspace_size(T * K));
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    ddp.poison();
    TensorView cdy = device_view(ddy.ptr, DType::kBFloat16, {T * K, H2}), cdp = device_view(ddp.ptr, DType::kFloat32, {T, K});
    TensorView cws = device_view(ws.ptr, DType::kInt32, {int64_t(ws.n)});
    moe_unpermute_backward(device_view(dg.ptr, DType::kBFloat16, {T, H2}), device_view(dyin.ptr, DType::kBFloat16, {T * K, H2}),
                           device_view(dmap.ptr, DType::kInt32, {K, T}), device_view(dp.ptr, DType::kFloat32, {T, K}),
                           cdy, cdp, cws, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    const std::vector<float> got_dp = ddp.download();
    if (run == 0) first = got_dp;
    else ASSERT_EQ(0, std::memcmp(first.data(), got_dp.data(), first.size() * 4)) << "run " << run;
  }
}
#endif
