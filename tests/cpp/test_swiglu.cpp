// SwiGLU on the CPU and CUDA against a float64 reference from the rounded inputs: bf16 / fp16 / fp32 (and
// fp64 on the CPU), odd and model widths, padded rows; outputs poisoned first; the recomputed y equal
// to the forward's bits; bad input names the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "mmfuse/swiglu.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

template <class S>
void run_case(int64_t T, int64_t I, int64_t pad, std::mt19937_64& rng, bool on_gpu) {
  const int64_t ld = 2 * I + pad, ldy = I + pad;
  std::vector<S> gu = random_vec<S>(size_t(std::max<int64_t>(1, T * ld)), rng, -6.0, 6.0);
  std::vector<S> dy = random_vec<S>(size_t(std::max<int64_t>(1, T * ldy)), rng);
  std::vector<S> y(size_t(std::max<int64_t>(1, T * ldy))), dgu(size_t(std::max<int64_t>(1, T * ld))), y2(y.size());
  poison(y);
  poison(dgu);
  poison(y2);
  auto hv = [](std::vector<S>& v, int64_t rows, int64_t cols, int64_t ld_) {
    return host_view(v.data(), dtype_of<S>(), {rows, cols}, {ld_, 1});
  };
  // the in-place pairs: gate_up becomes d_gate_up and dy becomes y, the same bits as out of place
  std::vector<S> gu_ip = gu, dy_ip = dy;
  if (!on_gpu) {
    TensorView yv = hv(y, T, I, ldy), dv = hv(dgu, T, 2 * I, ld), y2v = hv(y2, T, I, ldy);
    swiglu(hv(gu, T, 2 * I, ld), yv, nullptr);
    swiglu_backward(hv(dy, T, I, ldy), hv(gu, T, 2 * I, ld), dv, y2v, nullptr);
    TensorView gv = hv(gu_ip, T, 2 * I, ld), dyv = hv(dy_ip, T, I, ldy);
    swiglu_backward(dyv, gv, gv, dyv, nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    DeviceBuffer<S> dg(gu), dd(dy), dyo(y), ddg(dgu), dy2(y2);
    auto dvw = [](DeviceBuffer<S>& b, int64_t rows, int64_t cols, int64_t ld_) {
      return device_view(b.ptr, dtype_of<S>(), {rows, cols}, {ld_, 1});
    };
    Stream st;
    TensorView yv = dvw(dyo, T, I, ldy), dv = dvw(ddg, T, 2 * I, ld), y2v = dvw(dy2, T, I, ldy);
    swiglu(dvw(dg, T, 2 * I, ld), yv, st.s);
    swiglu_backward(dvw(dd, T, I, ldy), dvw(dg, T, 2 * I, ld), dv, y2v, st.s);
    TensorView gv = dvw(dg, T, 2 * I, ld), dyv = dvw(dd, T, I, ldy);
    swiglu_backward(dyv, gv, gv, dyv, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    y = dyo.download();
    dgu = ddg.download();
    y2 = dy2.download();
    gu_ip = dg.download();
    dy_ip = dd.download();
#endif
  }
  const double u = unit_roundoff<S>(), fu = std::is_same_v<S, double> ? 1e-15 : std::ldexp(1.0, -21);
  // half the smallest subnormal step of the dtype: the absolute error of a rounding near zero
  const double sub = std::is_same_v<S, f16> ? std::ldexp(1.0, -25) : std::is_same_v<S, bf16> ? std::ldexp(1.0, -134) : 1e-300;
  const std::string where = detail::cat("T", T, " I", I, " pad ", pad, on_gpu ? " CUDA" : " CPU");
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < I; ++j) {
      const double g = as_double(gu[size_t(t * ld + j)]), up = as_double(gu[size_t(t * ld + I + j)]);
      const double d = as_double(dy[size_t(t * ldy + j)]);
      const double sig = 1.0 / (1.0 + std::exp(-g)), s = g * sig;
      const double y_ref = s * up, dg_ref = d * up * sig * (1.0 + g * (1.0 - sig)), du_ref = d * s;
      // one rounding of the dtype, a few fp32 (fp64) operations before it
      ASSERT_NEAR(as_double(y[size_t(t * ldy + j)]), y_ref, (u + 8 * fu) * std::abs(y_ref) + sub) << where << " y";
      ASSERT_TRUE(bits_equal(y2[size_t(t * ldy + j)], y[size_t(t * ldy + j)])) << where << " recomputed y";
      ASSERT_NEAR(as_double(dgu[size_t(t * ld + j)]), dg_ref, (u + 16 * fu) * (std::abs(d * up) * 1.2) + sub)
          << where << " d_gate";
      ASSERT_NEAR(as_double(dgu[size_t(t * ld + I + j)]), du_ref, (u + 8 * fu) * std::abs(du_ref) + sub)
          << where << " d_up";
    }
    for (int64_t j = 0; j < 2 * I; ++j)
      ASSERT_TRUE(bits_equal(gu_ip[size_t(t * ld + j)], dgu[size_t(t * ld + j)])) << where << " in place d_gate_up";
    for (int64_t j = 0; j < I; ++j)
      ASSERT_TRUE(bits_equal(dy_ip[size_t(t * ldy + j)], y2[size_t(t * ldy + j)])) << where << " in place y";
    for (int64_t j = 2 * I; j < ld; ++j) {
      ASSERT_TRUE(std::isnan(as_double(dgu[size_t(t * ld + j)]))) << where << " pad";
      ASSERT_TRUE(bits_equal(gu_ip[size_t(t * ld + j)], gu[size_t(t * ld + j)])) << where << " in place pad";
    }
    for (int64_t j = I; j < ldy; ++j) ASSERT_TRUE(std::isnan(as_double(y[size_t(t * ldy + j)]))) << where << " pad";
  }
}

const int64_t kShapes[][3] = {{1, 1, 0}, {37, 13, 3}, {64, 8, 0}, {129, 1000, 8}, {33, 2752, 0}, {5, 11008, 0}};

}  // namespace

TEST(SwigluCpu, AgainstFloat64) {
  std::mt19937_64 rng(test_seed());
  for (const auto& s : kShapes) {
    run_case<bf16>(s[0], s[1], s[2], rng, false);
    run_case<f16>(s[0], s[1], s[2], rng, false);
    run_case<float>(s[0], s[1], s[2], rng, false);
    run_case<double>(s[0], s[1], s[2], rng, false);
  }
}

TEST(SwigluCpu, BadInputNamesTheProblem) {
  std::vector<bf16> gu(24), y(12);
  std::vector<float> yf(12);
  TensorView guv = host_view(gu.data(), DType::kBFloat16, {4, 6}), yv = host_view(y.data(), DType::kBFloat16, {4, 3});
  expect_error([&] {
    TensorView odd = host_view(gu.data(), DType::kBFloat16, {4, 5}, {6, 1});
    swiglu(odd, yv, nullptr);
  }, "swiglu: gate_up: expected an even number of columns (gate, then up), got 5");
  expect_error([&] {
    TensorView yf_v = host_view(yf.data(), DType::kFloat32, {4, 3});
    swiglu(guv, yf_v, nullptr);
  }, "swiglu: out: expected dtype bfloat16 (that of gate_up), got float32");
  expect_error([&] {
    TensorView inside = host_view(gu.data() + 3, DType::kBFloat16, {4, 3}, {6, 1});
    swiglu(guv, inside, nullptr);
  }, "swiglu: out overlaps gate_up");
  // in place only as the exact pairs (d_gate_up is gate_up, y is dy)
  std::vector<bf16> big(40), dyb(12);
  TensorView dyv = host_view(dyb.data(), DType::kBFloat16, {4, 3});
  expect_error([&] {
    TensorView shifted = host_view(gu.data() + 2, DType::kBFloat16, {3, 6});
    TensorView gu3 = host_view(gu.data(), DType::kBFloat16, {3, 6}), none;
    TensorView dy3 = host_view(dyb.data(), DType::kBFloat16, {3, 3});
    swiglu_backward(dy3, gu3, shifted, none, nullptr);
  }, "swiglu_backward: d_gate_up overlaps gate_up");
  expect_error([&] {
    TensorView y_in_gu = host_view(gu.data() + 3, DType::kBFloat16, {4, 3}, {6, 1});
    TensorView dv = host_view(big.data(), DType::kBFloat16, {4, 6});
    swiglu_backward(dyv, guv, dv, y_in_gu, nullptr);
  }, "swiglu_backward: y overlaps gate_up");
  expect_error([&] {
    TensorView y_in_dy = host_view(dyb.data() + 1, DType::kBFloat16, {3, 3});
    TensorView dy3 = host_view(dyb.data(), DType::kBFloat16, {3, 3});
    TensorView gu3 = host_view(gu.data(), DType::kBFloat16, {3, 6});
    TensorView dv = host_view(big.data(), DType::kBFloat16, {3, 6});
    swiglu_backward(dy3, gu3, dv, y_in_dy, nullptr);
  }, "swiglu_backward: y overlaps dy");
  expect_error([&] {
    TensorView expanded = host_view(big.data(), DType::kBFloat16, {4, 6}, {0, 1}), none;
    swiglu_backward(dyv, guv, expanded, none, nullptr);
  }, "swiglu_backward: d_gate_up: row stride 0 is below its 6 columns");
}

#ifdef MMFUSE_WITH_CUDA
TEST(SwigluCuda, AgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  for (const auto& s : kShapes) {
    run_case<bf16>(s[0], s[1], s[2], rng, true);
    run_case<f16>(s[0], s[1], s[2], rng, true);
    run_case<float>(s[0], s[1], s[2], rng, true);
  }
  run_case<bf16>(70000, 64, 0, rng, true);  // more rows than a grid's y dimension
}
#endif
