// Dual-expert GEMM on the CPU against a float64 reference: all four layouts, m in {0, 1, 7, 128},
// odd and aligned n and k, bf16 / fp16 / fp32 inputs, outputs in the input dtype or fp32,
// accumulation into fp32; bad input names the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda/dual_gemm/path.h"
#include "mmfuse/dual_gemm.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

struct Expert {
  int64_t m, n, k;
};

// Where a check runs: the CPU or the CUDA entry point.
enum class Run { kCpu, kCuda };

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
  dual_gemm(ca[0], cw[0], co[0], ca[1], cw[1], co[1], opt, cws, s);
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
        ASSERT_LE(std::abs(got - ref), tol) << (run == Run::kCpu ? "CPU " : "CUDA ") << "expert " << e << " (" << m << "x" << n << "x" << k << ") ta " << ta
                                            << " tb " << tb << " acc " << accumulate << " at " << i << "," << j;
      }
  }
}

}  // namespace

TEST(DualGemmPath, BiggerProductFirst) {
  using detail::dual_gemm::second_first;
  EXPECT_FALSE(second_first(8192, 11008, 2048, 1024, 2048, 2048));
  EXPECT_TRUE(second_first(128, 2048, 2752, 1024, 2048, 11008));
  EXPECT_FALSE(second_first(64, 64, 64, 64, 64, 64));  // a tie: expert 0 first
  EXPECT_TRUE(second_first(0, 64, 64, 1, 1, 1));
}

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

// Shapes past one wave of tiles and ragged sizes in each stored row length, through the library path.
TEST(DualGemmCuda, LargeAndRaggedAgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_dual<bf16, bf16>(rng, {2176, 2304, 16}, {8, 8, 32}, ta, tb, false, Run::kCuda);
      check_dual<bf16, bf16>(rng, {136, 33792, 72}, {8, 8, 8}, ta, tb, false, Run::kCuda);
    }
  const Expert ragged[][2] = {{{7, 33, 64}, {1, 300, 24}}, {{131, 257, 136}, {65, 1, 8}},
                              {{64, 72, 19}, {8, 256, 1}}, {{136, 264, 201}, {128, 8, 65}}};
  for (const auto& s : ragged) {
    check_dual<bf16, bf16>(rng, s[0], s[1], false, true, false, Run::kCuda);
    check_dual<bf16, float>(rng, s[0], s[1], true, false, true, Run::kCuda);
  }
}
#endif
