// MoE routing on the CPU against a float64 reference written independently (a stable sort of the
// flattened ids, gathers, weighted sums): K in {1, 2, 4, 8}, E in {2, 8, 64, 256}, dropping, empty
// experts, T = 0 and 1, odd H; bad expert ids.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

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
  moe_plan(iv, E, num_out, mv, cv, dv, nullptr);
  return p;
}

}  // namespace

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
          TensorView dv = host_view(const_cast<int32_t*>(p.d2s.data()), DType::kInt32, {n});
          TensorView mv = host_view(const_cast<int32_t*>(p.map.data()), DType::kInt32, {K, T});
          TensorView prv = host_view(pf.data(), DType::kFloat32, {T, K}), ov = host_view(out.data(), DType::kFloat64, {T, H});
          TensorView gv = host_view(dout.data(), DType::kFloat64, {T, H}), dyv = host_view(dy.data(), DType::kFloat64, {n, H});
          TensorView dpv = host_view(dprobs.data(), DType::kFloat32, {T, K});
          moe_permute(xv, dv, K, pv, nullptr);
          moe_unpermute(pv, mv, prv, ov, nullptr);
          moe_unpermute_backward(gv, pv, mv, prv, dyv, dpv, nullptr);
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
