// SwiGLU on the CPU and CUDA against a float64 reference from the rounded inputs: bf16 / fp16 / fp32 (and
// fp64 on the CPU), odd and model widths, padded rows; outputs poisoned first; the recomputed y equal
// to the forward's bits; bad input names the argument. The input packed in fp8 for the backward
// (swiglu_pack_fp8, swiglu_backward_fp8): the tile exponent against a brute-force search; every byte
// within half an e4m3 step of the input (an independent bound) and equal to the host conversion;
// non-finite values to NaN; CUDA bitwise equal to the CPU; the backward from the packed form bitwise
// equal to swiglu_backward on the unpacked values; padded rows untouched; bad input named.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/swiglu.h"
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

namespace {

// The largest k in [-126, 126] with amax * 2^k <= 448, by search.
int exponent_by_search(double amax) {
  if (amax == 0.0) return 0;
  for (int k = 126; k > -126; --k)
    if (std::ldexp(amax, k) <= 448.0) return k;
  return -126;
}

// Rows of mixed magnitude: each 128-column tile times its own power of two, some tiles all zero, a few
// Inf / NaN where `bad`.
template <class S>
std::vector<S> packed_input(int64_t T, int64_t C, int64_t ld, std::mt19937_64& rng, bool bad) {
  std::vector<S> v = random_vec<S>(size_t(std::max<int64_t>(1, T * ld)), rng, -3.0, 3.0);
  std::uniform_int_distribution<int> pw(std::is_same_v<S, f16> ? -8 : -40, std::is_same_v<S, f16> ? 8 : 40);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c0 = 0; c0 < C; c0 += kSwigluPackTile) {
      const int p = pw(rng);
      const bool zero = (t + c0 / kSwigluPackTile) % 7 == 3;
      for (int64_t j = c0; j < std::min(C, c0 + kSwigluPackTile); ++j) {
        S& x = v[size_t(t * ld + j)];
        x = from_double<S>(zero ? 0.0 : std::ldexp(as_double(x), p));
      }
    }
  if (bad && T * C > 10) {
    v[3] = from_double<S>(std::numeric_limits<double>::infinity());
    v[size_t((T - 1) * ld + C - 1)] = from_double<S>(std::nan(""));
  }
  return v;
}

template <class S>
void run_pack_case(int64_t T, int64_t I, int64_t pad, std::mt19937_64& rng) {
  const int64_t C = 2 * I, ld = C + pad, tiles = (C + kSwigluPackTile - 1) / kSwigluPackTile, lq = C + pad;
  const int64_t ls = tiles + 1;
  const std::vector<S> x = packed_input<S>(T, C, ld, rng, true);
  std::vector<uint8_t> q(size_t(std::max<int64_t>(1, T * lq)));
  std::vector<float> si(size_t(std::max<int64_t>(1, T * ls)));
  poison(q);
  poison(si);
  std::vector<S> xin = x;
  TensorView xv = host_view(xin.data(), dtype_of<S>(), {T, C}, {ld, 1});
  TensorView qv = host_view(q.data(), DType::kFloat8E4M3, {T, C}, {lq, 1});
  TensorView sv = host_view(si.data(), DType::kFloat32, {T, tiles}, {ls, 1});
  swiglu_pack_fp8(xv, qv, sv, nullptr);
  const std::string where = detail::cat("T", T, " I", I, " pad ", pad, " ", dtype_name(dtype_of<S>()));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < tiles; ++c) {
      double amax = 0.0;
      const int64_t j1 = std::min(C, (c + 1) * kSwigluPackTile);
      for (int64_t j = c * kSwigluPackTile; j < j1; ++j) {
        const double a = std::abs(as_double(x[size_t(t * ld + j)]));
        if (std::isfinite(a)) amax = std::max(amax, a);
      }
      const int k = exponent_by_search(amax);
      ASSERT_EQ(si[size_t(t * ls + c)], std::ldexp(1.0f, -k)) << where << " scale_inv of tile " << c;
      for (int64_t j = c * kSwigluPackTile; j < j1; ++j) {
        const double xs = std::ldexp(as_double(x[size_t(t * ld + j)]), k);
        const uint8_t b = q[size_t(t * lq + j)];
        if (!std::isfinite(xs)) {
          ASSERT_EQ(b & 0x7f, 0x7f) << where << " non-finite to NaN at " << j;
          continue;
        }
        // half an e4m3 step: 2^-4 relative for normals (|v| >= 2^-6), 2^-10 absolute below
        const double got = double(fp8_to_float(b, true));
        ASSERT_LE(std::abs(got - xs), std::max(std::ldexp(std::abs(xs), -4), std::ldexp(1.0, -10)))
            << where << " value at " << t << ", " << j;
        ASSERT_EQ(b, float_to_fp8(float(xs), true)) << where << " rounding at " << t << ", " << j;
      }
    }
    for (int64_t j = C; j < lq; ++j) ASSERT_EQ(q[size_t(t * lq + j)], 0xFF) << where << " q pad";
    ASSERT_TRUE(std::isnan(si[size_t(t * ls + tiles)])) << where << " scale_inv pad";
  }
#ifdef MMFUSE_WITH_CUDA
  if (!has_gpu()) return;
  DeviceBuffer<S> dx(x);
  std::vector<uint8_t> q0(q.size());
  std::vector<float> s0(si.size());
  poison(q0);
  poison(s0);
  DeviceBuffer<uint8_t> dq(q0);
  DeviceBuffer<float> ds(s0);
  Stream st;
  TensorView dxv = device_view(dx.ptr, dtype_of<S>(), {T, C}, {ld, 1});
  TensorView dqv = device_view(dq.ptr, DType::kFloat8E4M3, {T, C}, {lq, 1});
  TensorView dsv = device_view(ds.ptr, DType::kFloat32, {T, tiles}, {ls, 1});
  swiglu_pack_fp8(dxv, dqv, dsv, st.s);
  ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
  const std::vector<uint8_t> gq = dq.download();
  const std::vector<float> gs = ds.download();
  for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(gq[i], q[i]) << where << " CUDA q byte " << i;
  for (size_t i = 0; i < si.size(); ++i) ASSERT_TRUE(bits_equal(gs[i], si[i])) << where << " CUDA scale_inv " << i;
#endif
}

// swiglu_backward_fp8 against swiglu_backward on the unpacked values (exact in S): the same bits, with
// y recomputed, and y written over dy.
template <class S>
void run_backward_case(int64_t T, int64_t I, int64_t pad, std::mt19937_64& rng, bool on_gpu) {
  const int64_t C = 2 * I, tiles = (C + kSwigluPackTile - 1) / kSwigluPackTile, ldy = I + pad, ld = C + pad;
  std::vector<S> x = packed_input<S>(T, C, C, rng, false);
  std::vector<uint8_t> q(size_t(std::max<int64_t>(1, T * C)));
  std::vector<float> si(size_t(std::max<int64_t>(1, T * tiles)));
  TensorView qv = host_view(q.data(), DType::kFloat8E4M3, {T, C});
  TensorView sv = host_view(si.data(), DType::kFloat32, {T, tiles});
  swiglu_pack_fp8(host_view(x.data(), dtype_of<S>(), {T, C}), qv, sv, nullptr);
  std::vector<S> unpacked(size_t(std::max<int64_t>(1, T * C)));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < C; ++j)
      unpacked[size_t(t * C + j)] = from_double<S>(double(fp8_to_float(q[size_t(t * C + j)], true)) *
                                                   si[size_t(t * tiles + j / kSwigluPackTile)]);
  const std::vector<S> dy = random_vec<S>(size_t(std::max<int64_t>(1, T * ldy)), rng);
  std::vector<S> want_dg(size_t(std::max<int64_t>(1, T * ld))), want_y(dy.size()), got_dg(want_dg.size()),
      got_y(dy.size()), dy_ip = dy, dg_ip(want_dg.size());
  for (auto* v : {&want_dg, &want_y, &got_dg, &got_y, &dg_ip}) poison(*v);
  auto run = [&](auto mk, void* dyp, void* qp, void* sp, void* up, void* wdg, void* wy, void* gdg, void* gy, void* dyip,
                 void* dgip, cudaStream_t s) {
    TensorView dyv = mk(dyp, dtype_of<S>(), T, I, ldy), qq = mk(qp, DType::kFloat8E4M3, T, C, C);
    TensorView ss = mk(sp, DType::kFloat32, T, tiles, tiles), uv = mk(up, dtype_of<S>(), T, C, C);
    TensorView a = mk(wdg, dtype_of<S>(), T, C, ld), b = mk(wy, dtype_of<S>(), T, I, ldy);
    TensorView c = mk(gdg, dtype_of<S>(), T, C, ld), d = mk(gy, dtype_of<S>(), T, I, ldy);
    TensorView e = mk(dyip, dtype_of<S>(), T, I, ldy), f = mk(dgip, dtype_of<S>(), T, C, ld);
    swiglu_backward(dyv, uv, a, b, s);
    swiglu_backward_fp8(dyv, qq, ss, c, d, s);
    swiglu_backward_fp8(e, qq, ss, f, e, s);  // y over dy
  };
  if (!on_gpu) {
    std::vector<S> dy0 = dy;
    run([](void* p, DType t, int64_t r, int64_t c, int64_t l) { return host_view(p, t, {r, c}, {l, 1}); }, dy0.data(),
        q.data(), si.data(), unpacked.data(), want_dg.data(), want_y.data(), got_dg.data(), got_y.data(), dy_ip.data(),
        dg_ip.data(), nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    DeviceBuffer<S> ddy(dy), du(unpacked), a(want_dg), b(want_y), c(got_dg), d(got_y), e(dy_ip), f(dg_ip);
    DeviceBuffer<uint8_t> dq(q);
    DeviceBuffer<float> ds(si);
    Stream st;
    run([](void* p, DType t, int64_t r, int64_t cc, int64_t l) { return device_view(p, t, {r, cc}, {l, 1}); },
        ddy.ptr, dq.ptr, ds.ptr, du.ptr, a.ptr, b.ptr, c.ptr, d.ptr, e.ptr, f.ptr, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    want_dg = a.download();
    want_y = b.download();
    got_dg = c.download();
    got_y = d.download();
    dy_ip = e.download();
    dg_ip = f.download();
#endif
  }
  const std::string where = detail::cat("T", T, " I", I, " pad ", pad, " ", dtype_name(dtype_of<S>()),
                                        on_gpu ? " CUDA" : " CPU");
  for (size_t i = 0; i < want_dg.size(); ++i) {
    ASSERT_TRUE(bits_equal(got_dg[i], want_dg[i])) << where << " d_gate_up " << i;
    ASSERT_TRUE(bits_equal(dg_ip[i], want_dg[i])) << where << " d_gate_up (y over dy) " << i;
  }
  for (size_t i = 0; i < want_y.size(); ++i) {
    ASSERT_TRUE(bits_equal(got_y[i], want_y[i])) << where << " y " << i;
    if (int64_t(i % size_t(ldy)) < I) ASSERT_TRUE(bits_equal(dy_ip[i], want_y[i])) << where << " y over dy " << i;
  }
}

const int64_t kPackShapes[][3] = {{1, 1, 0}, {37, 13, 3}, {64, 64, 0}, {19, 100, 8}, {33, 2752, 0}, {5, 11008, 16}};

}  // namespace

TEST(SwigluPackExponent, AgainstSearch) {
  const float cases[] = {0.0f, 448.0f, 449.0f, 1.0f, 1.75f, 1.7500001f, 0.875f, 3.0e-38f, 1e-40f, FLT_MIN,
                         FLT_MAX, 224.0f, 447.99997f, 6.1e-5f, 1e30f};
  for (float a : cases) EXPECT_EQ(detail::swiglu_pack_exponent(float_bits(a)), exponent_by_search(a)) << a;
  std::mt19937_64 rng(test_seed());
  std::uniform_real_distribution<double> m(0.5, 1.0);
  std::uniform_int_distribution<int> e(-140, 127);
  for (int i = 0; i < 20000; ++i) {
    const float a = float(std::ldexp(m(rng), e(rng)));
    ASSERT_EQ(detail::swiglu_pack_exponent(float_bits(a)), exponent_by_search(a)) << a;
  }
}

TEST(SwigluPackFp8, CpuAgainstTheRuleAndCudaBitwise) {
  std::mt19937_64 rng(test_seed());
  for (const auto& s : kPackShapes) {
    run_pack_case<bf16>(s[0], s[1], s[2], rng);
    run_pack_case<f16>(s[0], s[1], s[2], rng);
    run_pack_case<float>(s[0], s[1], s[2], rng);
  }
}

TEST(SwigluBackwardFp8Cpu, EqualsSwigluBackwardOnTheUnpackedValues) {
  std::mt19937_64 rng(test_seed());
  for (const auto& s : kPackShapes) {
    run_backward_case<bf16>(s[0], s[1], s[2], rng, false);
    run_backward_case<float>(s[0], s[1], s[2], rng, false);
  }
}

#ifdef MMFUSE_WITH_CUDA
TEST(SwigluBackwardFp8Cuda, EqualsSwigluBackwardOnTheUnpackedValues) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  for (const auto& s : kPackShapes) {
    run_backward_case<bf16>(s[0], s[1], s[2], rng, true);
    run_backward_case<float>(s[0], s[1], s[2], rng, true);
  }
  run_backward_case<bf16>(70000, 64, 0, rng, true);  // more rows than a grid's y dimension
}
#endif

TEST(SwigluPackFp8, BadInputNamesTheProblem) {
  std::vector<bf16> gu(24), dy(12), dg(24);
  std::vector<uint8_t> q(24);
  std::vector<float> si(8);
  std::vector<double> gd(24);
  TensorView guv = host_view(gu.data(), DType::kBFloat16, {4, 6}), qv = host_view(q.data(), DType::kFloat8E4M3, {4, 6});
  TensorView sv = host_view(si.data(), DType::kFloat32, {4, 1}), none;
  expect_error([&] {
    TensorView g64 = host_view(gd.data(), DType::kFloat64, {4, 6});
    swiglu_pack_fp8(g64, qv, sv, nullptr);
  }, "swiglu_pack_fp8: gate_up: expected bfloat16, float16 or float32, got float64");
  expect_error([&] {
    TensorView qb = host_view(q.data(), DType::kUInt8, {4, 6});
    swiglu_pack_fp8(guv, qb, sv, nullptr);
  }, "swiglu_pack_fp8: q: expected dtype float8_e4m3fn, got uint8");
  expect_error([&] {
    TensorView s2 = host_view(si.data(), DType::kFloat32, {4, 2});
    swiglu_pack_fp8(guv, qv, s2, nullptr);
  }, "swiglu_pack_fp8: scale_inv: expected shape [4, 1], got [4, 2]");
  expect_error([&] {
    TensorView q_in_gu = host_view(reinterpret_cast<char*>(gu.data()) + 8, DType::kFloat8E4M3, {4, 6});
    swiglu_pack_fp8(guv, q_in_gu, sv, nullptr);
  }, "swiglu_pack_fp8: q overlaps gate_up");
  TensorView dyv = host_view(dy.data(), DType::kBFloat16, {4, 3}), dgv = host_view(dg.data(), DType::kBFloat16, {4, 6});
  expect_error([&] {
    TensorView qodd = host_view(q.data(), DType::kFloat8E4M3, {4, 5}, {6, 1});
    swiglu_backward_fp8(dyv, qodd, sv, dgv, none, nullptr);
  }, "swiglu_backward_fp8: q: expected a 2-D tensor [T, 2I] (swiglu_pack_fp8's), got [4, 5]");
  expect_error([&] {
    TensorView dy2 = host_view(dy.data(), DType::kBFloat16, {4, 2}, {3, 1});
    swiglu_backward_fp8(dy2, qv, sv, dgv, none, nullptr);
  }, "swiglu_backward_fp8: dy: expected shape [4, 3], got [4, 2]");
  expect_error([&] {
    TensorView y_in_dg = host_view(dg.data() + 1, DType::kBFloat16, {4, 3}, {6, 1});
    swiglu_backward_fp8(dyv, qv, sv, dgv, y_in_dg, nullptr);
  }, "swiglu_backward_fp8: y overlaps d_gate_up");
  expect_error([&] {
    TensorView y_shift = host_view(dy.data() + 1, DType::kBFloat16, {3, 3});
    TensorView dy3 = host_view(dy.data(), DType::kBFloat16, {3, 3});
    TensorView q3 = host_view(q.data(), DType::kFloat8E4M3, {3, 6});
    TensorView s3 = host_view(si.data(), DType::kFloat32, {3, 1}), dg3 = host_view(dg.data(), DType::kBFloat16, {3, 6});
    swiglu_backward_fp8(dy3, q3, s3, dg3, y_shift, nullptr);
  }, "swiglu_backward_fp8: y overlaps dy");
}
