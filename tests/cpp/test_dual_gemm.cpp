// Dual-expert GEMM on the CPU against a float64 reference: all four layouts, m in {0, 1, 7, 128},
// odd and aligned n and k, bf16 / fp16 / fp32 inputs, outputs in the input dtype or fp32,
// accumulation into fp32; bad input names the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "mmfuse/dual_gemm.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

struct Expert {
  int64_t m, n, k;
};

// Checks one random dual problem of input type S and output type O against float64.
template <class S, class O>
void check_dual(std::mt19937_64& rng, Expert e0, Expert e1, bool ta, bool tb, bool accumulate) {
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
  dual_gemm(av[0], wv[0], ov[0], av[1], wv[1], ov[1], opt, nullptr);
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
        ASSERT_LE(std::abs(got - ref), tol) << "expert " << e << " (" << m << "x" << n << "x" << k << ") ta " << ta
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
  TensorView a0 = host_view(a.data(), DType::kBFloat16, {6, 4}), w0 = host_view(w.data(), DType::kBFloat16, {4, 5});
  TensorView o0 = host_view(out.data(), DType::kBFloat16, {6, 5}), of = host_view(outf.data(), DType::kFloat32, {6, 5});
  DualGemmOptions opt;
  expect_error([&] { dual_gemm(a0, w0, o0, a0, host_view(w.data(), DType::kBFloat16, {5, 4}), o0, opt, nullptr); },
               "w1: expected 4 along its k dim (that of a1; trans_a=False, trans_b=False), got shape [5, 4]");
  TensorView o_t = host_view(out.data(), DType::kBFloat16, {5, 6});
  expect_error([&] { dual_gemm(a0, w0, o0, a0, w0, o_t, opt, nullptr); },
               "out1: expected shape [6, 5], got [5, 6]");
  TensorView strided = host_view(wide.data(), DType::kBFloat16, {6, 5}, {10, 1});
  expect_error([&] { dual_gemm(a0, w0, strided, a0, w0, o0, opt, nullptr); },
               "out0: expected a contiguous tensor (outputs are written in place), got strides [10, 1]");
  opt.accumulate = true;
  expect_error([&] { dual_gemm(a0, w0, of, a0, w0, o0, opt, nullptr); },
               "out1: accumulate=True needs a float32 output, got bfloat16");
  opt.accumulate = false;
  expect_error([&] { dual_gemm(a0, w0, o0, host_view(outf.data(), DType::kFloat32, {6, 4}), w0, o0, opt, nullptr); },
               "a1: expected dtype bfloat16 (that of a0), got float32");
  TensorView cuda_a = a0;
  cuda_a.device = Device{DeviceType::kCUDA, 0};
  expect_error([&] { dual_gemm(cuda_a, w0, o0, a0, w0, o0, opt, nullptr); },
               "w0: expected a tensor on cuda:0 (that of a0), got cpu");
}
