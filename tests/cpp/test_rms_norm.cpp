// Residual add + RMSNorm on the CPU and CUDA against a float64 reference computed from the rounded
// inputs: bf16 / fp16 / fp32 (and fp64 on the CPU), odd and model sizes, with and without a residual,
// every grouping (x and out grouped or not, splits 0 < S < L, 0 and L), strided rows; outputs poisoned
// first; bad input names the argument; the launch shape rule on the host.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backends/rms_norm.h"
#include "cuda/rms_norm/path.h"
#include "mmfuse/rms_norm.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

struct Case {
  int64_t T, H;
  bool residual, x_grouped, out_grouped, dh;
  int64_t L, S;  // grouping: L = 0 none
  int64_t pad;   // extra elements at the end of each row (row stride H + pad)
};

std::string name(const Case& c) {
  using detail::cat;
  return cat("T", c.T, " H", c.H, c.residual ? " res" : "", c.dh ? " dh" : "", c.L ? cat(" L", c.L, " S", c.S) : "",
             c.x_grouped ? " xg" : "", c.out_grouped ? " og" : "", c.pad ? " padded" : "");
}
// A [T, H] host buffer with row stride H + pad: the poisoned pad must survive.
template <class S>
struct Mat {
  int64_t T, H, ld;
  std::vector<S> v;
  Mat(int64_t t, int64_t h, int64_t pad) : T(t), H(h), ld(h + pad), v(size_t(std::max<int64_t>(1, t * (h + pad)))) {
    poison(v);
  }
  S& at(int64_t r, int64_t j) { return v[size_t(r * ld + j)]; }
  TensorView view() { return host_view(v.data(), dtype_of<S>(), {T, H}, {ld, 1}); }
};

template <class S>
Mat<S> random_mat(int64_t T, int64_t H, int64_t pad, std::mt19937_64& rng) {
  Mat<S> m(T, H, pad);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t j = 0; j < H; ++j) m.at(r, j) = from_double<S>(std::uniform_real_distribution<double>(-2, 2)(rng));
  return m;
}

// ||a - b|| / ||b|| over matching entries
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double n = 0, d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    n += (a[i] - b[i]) * (a[i] - b[i]);
    d += b[i] * b[i];
  }
  return std::sqrt(n / std::max(d, 1e-300));
}

template <class S>
std::vector<double> rows_of(Mat<S>& m) {
  std::vector<double> out;
  for (int64_t r = 0; r < m.T; ++r)
    for (int64_t j = 0; j < m.H; ++j) out.push_back(as_double(m.at(r, j)));
  return out;
}

template <class S>
void run_case(const Case& c, std::mt19937_64& rng, bool on_gpu) {
  using Stat = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const int64_t T = c.T, H = c.H;
  RmsNormGrouping g;
  g.seq_len = c.L;
  g.split = c.S;
  g.x_grouped = c.x_grouped;
  g.out_grouped = c.out_grouped;
  const detail::RowGroups rg{c.L, c.S, c.L ? T / c.L : 0};
  const double eps = 1e-6, u = unit_roundoff<S>();
  Mat<S> x = random_mat<S>(T, H, c.pad, rng), res = random_mat<S>(T, H, c.pad, rng);
  std::vector<S> w(static_cast<size_t>(H));
  for (auto& e : w) e = from_double<S>(std::uniform_real_distribution<double>(0.5, 1.5)(rng));
  Mat<S> out(T, H, c.pad), hout(T, H, c.pad);
  std::vector<Stat> rstd(static_cast<size_t>(T));
  poison(rstd);
  const bool writes_h = c.residual || c.x_grouped;
  // float64 reference from the rounded inputs
  std::vector<double> h_ref(size_t(T * H)), out_ref(size_t(T * H)), r_ref(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) {
      double v = as_double(x.at(rg.row(t, c.x_grouped), j));
      if (c.residual) v = as_double(from_double<S>(v + as_double(res.at(t, j))));
      h_ref[size_t(t * H + j)] = v;
      ss += v * v;
    }
    r_ref[size_t(t)] = 1.0 / std::sqrt(ss / double(H) + eps);
    const int64_t o = rg.row(t, c.out_grouped);
    for (int64_t j = 0; j < H; ++j)
      out_ref[size_t(o * H + j)] = as_double(w[size_t(j)]) * h_ref[size_t(t * H + j)] * r_ref[size_t(t)];
  }
  // backward inputs and reference
  Mat<S> dout = random_mat<S>(T, H, c.pad, rng), dh = random_mat<S>(T, H, c.pad, rng);
  Mat<S> dx(T, H, c.pad), dres(T, H, c.pad);
  std::vector<Stat> dw(static_cast<size_t>(H));
  poison(dw);
  std::vector<double> dx_ref(size_t(T * H)), dx_mag(size_t(T * H)), dw_ref(size_t(H), 0.0),
      dw_mag(static_cast<size_t>(H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double r = r_ref[size_t(t)];
    double dot = 0;
    std::vector<double> gw(static_cast<size_t>(H)), xh(static_cast<size_t>(H));
    for (int64_t j = 0; j < H; ++j) {
      const double d = as_double(dout.at(rg.row(t, c.out_grouped), j));
      gw[size_t(j)] = d * as_double(w[size_t(j)]);
      xh[size_t(j)] = h_ref[size_t(t * H + j)] * r;
      dot += gw[size_t(j)] * xh[size_t(j)];
      const double term = d * as_double(from_double<S>(xh[size_t(j)]));
      dw_ref[size_t(j)] += term;
      dw_mag[size_t(j)] += std::abs(term);
    }
    const int64_t xr = rg.row(t, c.x_grouped);
    double dot_abs = 0;
    for (int64_t j = 0; j < H; ++j) dot_abs += std::abs(gw[size_t(j)] * xh[size_t(j)]);
    for (int64_t j = 0; j < H; ++j) {
      dx_ref[size_t(xr * H + j)] =
          r * (gw[size_t(j)] - xh[size_t(j)] * dot / double(H)) + (c.dh ? as_double(dh.at(t, j)) : 0.0);
      // the size of the terms, for the compute type's error (r * gw and r * xh * mean cancel at small H)
      dx_mag[size_t(xr * H + j)] = r * (std::abs(gw[size_t(j)]) + std::abs(xh[size_t(j)]) * dot_abs / double(H));
    }
  }
  const std::string where = name(c) + (on_gpu ? " CUDA" : " CPU");
  TensorView none;
  if (!on_gpu) {
    TensorView ov = out.view(), hv = writes_h ? hout.view() : none, rv = host_view(rstd.data(), dtype_of<Stat>(), {T});
    rms_norm(x.view(), c.residual ? res.view() : none, host_view(w.data(), dtype_of<S>(), {H}), eps, g, ov, hv, rv,
             nullptr);
    TensorView dxv = dx.view(), drv = c.x_grouped ? dres.view() : none, dwv = host_view(dw.data(), dtype_of<Stat>(), {H});
    TensorView ws;
    rms_norm_backward(dout.view(), c.dh ? dh.view() : none, writes_h ? hout.view() : x.view(), rv,
                      host_view(w.data(), dtype_of<S>(), {H}), g, dxv, drv, dwv, ws, nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    auto dev = [](Mat<S>& m, DeviceBuffer<S>& b) { return device_view(b.ptr, dtype_of<S>(), {m.T, m.H}, {m.ld, 1}); };
    DeviceBuffer<S> dx_(x.v), dres_(res.v), dw_(w), dout_buf(out.v), dh_buf(hout.v), dgo(dout.v), dgh(dh.v),
        ddx(dx.v), ddres(dres.v);
    DeviceBuffer<Stat> drstd(rstd), ddw(dw);
    DeviceBuffer<float> ws(size_t(rms_norm_backward_workspace_size(T, H)));
    Stream st;
    TensorView ov = dev(out, dout_buf), hv = writes_h ? dev(hout, dh_buf) : none;
    TensorView rv = device_view(drstd.ptr, dtype_of<Stat>(), {T}), wv = device_view(dw_.ptr, dtype_of<S>(), {H});
    rms_norm(dev(x, dx_), c.residual ? dev(res, dres_) : none, wv, eps, g, ov, hv, rv, st.s);
    TensorView dxv = dev(dx, ddx), drv = c.x_grouped ? dev(dres, ddres) : none;
    TensorView dwv = device_view(ddw.ptr, dtype_of<Stat>(), {H}), wsv = device_view(ws.ptr, DType::kFloat32, {int64_t(ws.n)});
    rms_norm_backward(dev(dout, dgo), c.dh ? dev(dh, dgh) : none, writes_h ? hv : dev(x, dx_), rv, wv, g, dxv, drv,
                      dwv, wsv, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess) << where;
    out.v = dout_buf.download();
    hout.v = dh_buf.download();
    rstd = drstd.download();
    dx.v = ddx.download();
    dres.v = ddres.download();
    dw = ddw.download();
#endif
  }
  // every row written, the pads untouched
  for (Mat<S>* m : {&out, &dx}) {
    for (int64_t r = 0; r < T; ++r) {
      for (int64_t j = 0; j < H; ++j) ASSERT_TRUE(std::isfinite(as_double(m->at(r, j)))) << where << " row " << r;
      for (int64_t j = H; j < m->ld; ++j) ASSERT_TRUE(std::isnan(as_double(m->at(r, j)))) << where << " pad written";
    }
  }
  // out: two roundings of the dtype at most (one ulp: 2u), the fp32 statistics' error on top
  const double cu = std::is_same_v<S, double> ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);  // compute type
  const double stat = 4 * std::sqrt(double(H)) * cu;  // a sum of H squares, relative
  const double tol = 2.5 * u + stat;
  EXPECT_LE(rel_err(rows_of(out), out_ref), tol) << where << " out";
  for (int64_t t = 0; t < T; ++t)
    ASSERT_NEAR(double(rstd[size_t(t)]), r_ref[size_t(t)], r_ref[size_t(t)] * (stat + 4 * cu))
        << where << " rstd " << t;
  if (writes_h) EXPECT_LE(rel_err(rows_of(hout), h_ref), u) << where << " h";
  // dx: one rounding of the dtype, the compute type's error on the terms (with rstd's)
  {
    const std::vector<double> got = rows_of(dx);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], dx_ref[i], u * std::abs(dx_ref[i]) + (8 * cu + stat) * dx_mag[i] * 4 + 1e-30)
          << where << " dx " << i;
  }
  if (c.x_grouped) {
    std::vector<double> dres_ref(static_cast<size_t>(T * H));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < H; ++j) dres_ref[size_t(t * H + j)] = dx_ref[size_t(rg.row(t, true) * H + j)];
    const std::vector<double> dxv = rows_of(dx);  // dresidual: dx's values in token order
    std::vector<double> want(dxv.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < H; ++j) want[size_t(t * H + j)] = dxv[size_t(rg.row(t, true) * H + j)];
    EXPECT_EQ(rows_of(dres), want) << where << " dresidual";
  }
  // dweight: a term's round(xhat) may round the other way (2u), then T terms summed in the compute type
  for (int64_t j = 0; j < H; ++j)
    ASSERT_NEAR(double(dw[size_t(j)]), dw_ref[size_t(j)], (2 * u + stat + double(T + 2) * 2 * cu) * dw_mag[size_t(j)] + 1e-30)
        << where << " dweight " << j;
}

const Case kCases[] = {
    {1, 1, false, false, false, false, 0, 0, 0},
    {37, 13, true, false, false, true, 0, 0, 3},
    {64, 2048, true, false, false, true, 0, 0, 0},
    {21, 96, true, true, true, true, 7, 3, 0},     // both grouped
    {21, 96, false, true, false, false, 7, 3, 8},  // x grouped without a residual (h written), padded rows
    {21, 200, true, false, true, false, 7, 0, 0},  // all of group 1
    {21, 200, true, true, false, true, 7, 7, 0},   // all of group 0
    {12, 3584, true, false, true, true, 4, 3, 0},  // a 7B row (two vectors a thread)
    {5, 20000, true, true, true, true, 5, 2, 0},   // 2500 vectors: eight a thread
    {4, 8195, true, true, true, true, 2, 1, 0},    // 8195 single elements: past the register path (streamed)
    {3, 33, false, false, false, false, 0, 0, 5},  // odd H: narrow accesses
};

}  // namespace

TEST(RmsNormCpu, AgainstFloat64) {
  std::mt19937_64 rng(test_seed());
  for (const Case& c : kCases) {
    run_case<bf16>(c, rng, false);
    run_case<f16>(c, rng, false);
    run_case<float>(c, rng, false);
    run_case<double>(c, rng, false);
  }
}

TEST(RmsNormCpu, BadInputNamesTheProblem) {
  std::vector<bf16> x(24), w(6), out(24), h(24);
  std::vector<float> r(4), rw(6);
  std::vector<float> xf(24);
  TensorView xv = host_view(x.data(), DType::kBFloat16, {4, 6}), wv = host_view(w.data(), DType::kBFloat16, {6});
  TensorView ov = host_view(out.data(), DType::kBFloat16, {4, 6}), hv = host_view(h.data(), DType::kBFloat16, {4, 6});
  TensorView rv = host_view(r.data(), DType::kFloat32, {4}), none;
  RmsNormGrouping g;
  expect_error([&] { rms_norm(xv, none, host_view(w.data(), DType::kBFloat16, {5}), 1e-6, g, ov, hv, rv, nullptr); },
               "rms_norm: weight: expected shape [6], got [5]");
  expect_error([&] { rms_norm(xv, host_view(xf.data(), DType::kFloat32, {4, 6}), wv, 1e-6, g, ov, hv, rv, nullptr); },
               "rms_norm: residual: expected dtype bfloat16, got float32");
  expect_error([&] { rms_norm(xv, none, wv, -1.0, g, ov, hv, rv, nullptr); },
               "rms_norm: eps: expected a finite value >= 0, got -1");
  expect_error([&] { rms_norm(xv, none, wv, 1e-6, g, xv, hv, rv, nullptr); }, "rms_norm: out overlaps x");
  TensorView half = host_view(x.data() + 12, DType::kBFloat16, {4, 6});
  expect_error([&] { rms_norm(xv, none, wv, 1e-6, g, half, hv, rv, nullptr); }, "rms_norm: out overlaps x");
  g.seq_len = 3;
  g.split = 1;
  expect_error([&] { rms_norm(xv, none, wv, 1e-6, g, ov, hv, rv, nullptr); },
               "rms_norm: seq_len: expected a divisor of the 4 tokens, got 3");
  g.seq_len = 2;
  g.split = 3;
  expect_error([&] { rms_norm(xv, none, wv, 1e-6, g, ov, hv, rv, nullptr); },
               "rms_norm: split: expected in [0, seq_len = 2], got 3");
  g = RmsNormGrouping{};
  g.x_grouped = true;
  expect_error([&] { rms_norm(xv, none, wv, 1e-6, g, ov, hv, rv, nullptr); },
               "rms_norm: x_grouped / out_grouped need a grouping (seq_len > 0)");
  g = RmsNormGrouping{};
  TensorView strided = host_view(x.data(), DType::kBFloat16, {4, 3}, {6, 2});
  expect_error([&] { rms_norm(strided, none, host_view(w.data(), DType::kBFloat16, {3}), 1e-6, g, ov, hv, rv, nullptr); },
               "rms_norm: x: the last dim must be contiguous, got strides [6, 2]");
  TensorView dwv = host_view(rw.data(), DType::kFloat32, {6}), ws;
  expect_error([&] { rms_norm_backward(ov, none, xv, rv, wv, g, ov, hv, dwv, ws, nullptr); },
               "rms_norm_backward: dx overlaps dout");
}

TEST(RmsNormPath, RowShape) {
  using detail::rms_norm::row_shape;
  EXPECT_EQ(row_shape(256).vectors_per_thread, 1);  // H 2048 bf16
  EXPECT_EQ(row_shape(256).threads, 256);
  EXPECT_EQ(row_shape(448).vectors_per_thread, 2);  // H 3584 bf16
  EXPECT_EQ(row_shape(448).threads, 224);
  EXPECT_EQ(row_shape(2).threads, 32);  // at least a warp
  EXPECT_EQ(row_shape(1024).vectors_per_thread, 4);
  EXPECT_EQ(row_shape(8192).vectors_per_thread, 8);
  EXPECT_EQ(row_shape(8192).threads, 1024);
  EXPECT_EQ(row_shape(8193).vectors_per_thread, 0);  // streamed
  EXPECT_EQ(detail::rms_norm::backward_blocks(10, 132, 1024), 10);
  EXPECT_EQ(detail::rms_norm::backward_blocks(100000, 132, 1024), 528);
  EXPECT_EQ(detail::rms_norm::backward_blocks(100000, 132, 300), 300);
  EXPECT_TRUE(detail::rms_norm::backward_prefetch(1, 0));    // H 2048 bf16: two rows in registers
  EXPECT_FALSE(detail::rms_norm::backward_prefetch(1, 2));   // MMFUSE_RMS_NORM_BWD=single
  EXPECT_FALSE(detail::rms_norm::backward_prefetch(2, 0));   // H 3584 bf16: one row (it would spill)
  EXPECT_FALSE(detail::rms_norm::backward_prefetch(2, 1));   // not compiled there: the override falls back
  EXPECT_FALSE(detail::rms_norm::backward_prefetch(0, 0));   // streamed rows
}

#ifdef MMFUSE_WITH_CUDA
TEST(RmsNormCuda, AgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  for (const Case& c : kCases) {
    run_case<bf16>(c, rng, true);
    run_case<f16>(c, rng, true);
    run_case<float>(c, rng, true);
  }
  run_case<bf16>({16384, 2048, true, true, true, true, 4096, 3840, 0}, rng, true);  // the VLA step's shape
}

// Both row kernels of the backward (MMFUSE_RMS_NORM_BWD) with more rows than blocks, so that the
// prefetching one carries rows from one iteration into the next.
TEST(RmsNormCuda, BackwardPathsAgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  struct Restore {
    ~Restore() { set_path_override("MMFUSE_RMS_NORM_BWD", ""); }
  } restore;
  std::mt19937_64 rng(test_seed());
  for (const char* mode : {"prefetch", "single"}) {
    SCOPED_TRACE(mode);
    set_path_override("MMFUSE_RMS_NORM_BWD", mode);
    run_case<bf16>({1501, 2048, false, false, false, false, 0, 0, 8}, rng, true);
    run_case<f16>({1500, 2048, true, true, false, true, 300, 44, 0}, rng, true);
    run_case<bf16>({1500, 2000, true, false, true, true, 250, 3, 0}, rng, true);  // 250 vectors: a partial warp
  }
}
#endif
