// linear_cross_entropy's logits gradient on the CPU and CUDA (both kernels) against a float64 reference
// from the same fp32 logits: label smoothing, z-loss and the softcap each on and off, ignored rows,
// padded rows, odd and vocabulary-size widths, bf16 / fp16 / fp32 gradients; outputs poisoned first;
// bad input names the argument; the one-read kernel's launch shape.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/linear_cross_entropy/path.h"
#include "mmfuse/common.h"
#include "mmfuse/linear_cross_entropy.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

struct Opts {
  float eps, zl, cap;
};

// S: the gradient's dtype; Z: the logits' (float32, or S).
template <class S, class Z = float>
void run_case(int64_t C, int64_t V, int64_t pad, Opts o, std::mt19937_64& rng, bool on_gpu) {
  const int64_t ld = V + pad;
  const int64_t ignore = -100;
  std::vector<Z> z = random_vec<Z>(size_t(std::max<int64_t>(1, C * ld)), rng, -8.0, 8.0);
  std::vector<int64_t> y(size_t(std::max<int64_t>(1, C)));
  std::vector<float> rs(y.size()), loss(y.size());
  std::uniform_int_distribution<int64_t> cls(0, V - 1);
  for (int64_t r = 0; r < C; ++r) {
    y[size_t(r)] = r % 5 == 3 ? ignore : cls(rng);
    rs[size_t(r)] = float(0.25 + 0.5 * double(r % 3));
  }
  std::vector<S> g(size_t(std::max<int64_t>(1, C * ld)));
  poison(g);
  poison(loss);
  if (!on_gpu) {
    TensorView lv = host_view(loss.data(), DType::kFloat32, {C}), gv = host_view(g.data(), dtype_of<S>(), {C, V}, {ld, 1});
    linear_cross_entropy_logits_grad(host_view(z.data(), dtype_of<Z>(), {C, V}, {ld, 1}),
                                     host_view(y.data(), DType::kInt64, {C}), host_view(rs.data(), DType::kFloat32, {C}),
                                     ignore, o.eps, o.zl, o.cap, lv, gv, nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    DeviceBuffer<Z> dz(z);
    DeviceBuffer<float> drs(rs), dl(loss);
    DeviceBuffer<int64_t> dy(y);
    DeviceBuffer<S> dg(g);
    Stream st;
    TensorView lv = device_view(dl.ptr, DType::kFloat32, {C}), gv = device_view(dg.ptr, dtype_of<S>(), {C, V}, {ld, 1});
    linear_cross_entropy_logits_grad(device_view(dz.ptr, dtype_of<Z>(), {C, V}, {ld, 1}),
                                     device_view(dy.ptr, DType::kInt64, {C}), device_view(drs.ptr, DType::kFloat32, {C}),
                                     ignore, o.eps, o.zl, o.cap, lv, gv, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    loss = dl.download();
    g = dg.download();
#endif
  }
  const double u = unit_roundoff<S>();
  // half the smallest subnormal step of the dtype: the absolute error of a rounding near zero
  const double sub = std::is_same_v<S, f16> ? std::ldexp(1.0, -25) : std::is_same_v<S, bf16> ? std::ldexp(1.0, -134)
                                                                                               : std::ldexp(1.0, -150);
  const std::string where = detail::cat("C", C, " V", V, " pad ", pad, " eps ", o.eps, " z_loss ", o.zl, " cap ", o.cap,
                                        on_gpu ? " CUDA" : " CPU");
  for (int64_t r = 0; r < C; ++r) {
    auto zr = [&](int64_t j) { return as_double(z[size_t(r * ld + j)]); };
    const int64_t yr = y[size_t(r)];
    auto soft = [&](double v) { return o.cap > 0 ? o.cap * std::tanh(v / o.cap) : v; };
    if (yr == ignore) {
      ASSERT_EQ(loss[size_t(r)], 0.0f) << where << " ignored row " << r;
      for (int64_t j = 0; j < V; ++j) ASSERT_EQ(as_double(g[size_t(r * ld + j)]), 0.0) << where << " ignored row";
      continue;
    }
    double m = -INFINITY, s = 0, zsum = 0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, soft(zr(j)));
    for (int64_t j = 0; j < V; ++j) {
      s += std::exp(soft(zr(j)) - m);
      zsum += soft(zr(j));
    }
    const double lse = m + std::log(s);
    const double l_ref = (1 - o.eps) * (lse - soft(zr(yr))) + o.eps * (lse - zsum / double(V)) + o.zl * lse * lse;
    ASSERT_NEAR(loss[size_t(r)], l_ref, 2e-5 * (std::abs(l_ref) + std::abs(lse))) << where << " loss row " << r;
    for (int64_t j = 0; j < V; ++j) {
      const double v = soft(zr(j)), p = std::exp(v - lse);
      double d = p * (1 + 2 * o.zl * lse) - o.eps / double(V) - (j == yr ? 1 - o.eps : 0.0);
      if (o.cap > 0) d *= 1 - (v / o.cap) * (v / o.cap);
      const double want = d * rs[size_t(r)];
      // one rounding of the dtype after fp32 math: exp's and the lse's error scale p; the terms'
      // own roundings scale their sizes
      const double terms = p * (1 + 2 * o.zl * std::abs(lse)) + o.eps / double(V) + (j == yr ? 1.0 : 0.0);
      const double tol = u * std::abs(want) +
                         rs[size_t(r)] * (4e-6 * p * (1 + 2 * o.zl * std::abs(lse)) * (1 + std::abs(v - lse)) +
                                          8 * std::ldexp(1.0, -24) * terms) + sub;
      ASSERT_NEAR(as_double(g[size_t(r * ld + j)]), want, tol) << where << " g row " << r << " col " << j;
    }
    for (int64_t j = V; j < ld; ++j) ASSERT_TRUE(std::isnan(as_double(g[size_t(r * ld + j)]))) << where << " pad";
  }
}

const Opts kOpts[] = {{0, 0, 0}, {0.1f, 0, 0}, {0, 1e-3f, 0}, {0, 0, 30.0f}, {0.05f, 1e-4f, 15.0f}};
// with the one-read kernel forced (CUDA): rows of 1 (1000), 2 (60000), 4 (bf16 151936) and 8 (fp32
// 151936) blocks; 13 and 4099 are not 16-byte rows (the two-pass kernel)
const int64_t kShapes[][3] = {{1, 1, 0}, {7, 13, 3}, {16, 1000, 0}, {9, 4099, 5}, {5, 60000, 8}, {3, 151936, 0}};

template <class S, class Z = float>
void all_cases(bool on_gpu) {
  std::mt19937_64 rng(test_seed());
  for (const auto& s : kShapes)
    for (const Opts& o : kOpts) run_case<S, Z>(s[0], s[1], s[2], o, rng, on_gpu);
}

}  // namespace

TEST(LinearCrossEntropyCpu, LogitsGradAgainstFloat64) {
  all_cases<bf16>(false);
  all_cases<f16>(false);
  all_cases<float>(false);
  all_cases<bf16, bf16>(false);  // logits in the hidden dtype
  all_cases<f16, f16>(false);
}

TEST(LinearCrossEntropyPath, OneReadKernelShape) {
  using detail::lce::GradForce;
  using detail::lce::grad_launch;
  const auto cluster = GradForce::kCluster;
  // the fewest blocks a row whose 16-byte-rounded slices fit 96 KiB
  EXPECT_EQ(grad_launch(151936, 2, true, 90, cluster).cluster, 4);
  EXPECT_EQ(grad_launch(151936, 2, true, 90, cluster).slice, 37984);
  EXPECT_EQ(grad_launch(151936, 4, true, 90, cluster).cluster, 8);
  EXPECT_EQ(grad_launch(151936, 4, true, 90, cluster).slice, 18992);
  EXPECT_EQ(grad_launch(60000, 2, true, 90, cluster).cluster, 2);
  EXPECT_EQ(grad_launch(1000, 2, true, 90, cluster).cluster, 1);
  EXPECT_EQ(grad_launch(1000, 2, true, 90, cluster).slice, 1000);
  EXPECT_EQ(grad_launch(49152, 2, true, 90, cluster).cluster, 1);  // exactly 96 KiB
  EXPECT_EQ(grad_launch(49160, 2, true, 90, cluster).cluster, 2);
  // a slice is whole 16-byte vectors; the last block may hold less
  EXPECT_EQ(grad_launch(60008, 2, true, 90, cluster).slice, 30008);
  EXPECT_EQ(grad_launch(3 * 8 * 4096 + 8, 2, true, 90, cluster).slice % 8, 0);
  // the two-pass kernel: rows past 8 blocks, unaligned rows, before sm_90, on request, and (for now) auto
  EXPECT_EQ(grad_launch(8 * 49152 + 8, 2, true, 90, cluster).cluster, 0);
  EXPECT_EQ(grad_launch(151936, 2, false, 90, cluster).cluster, 0);
  EXPECT_EQ(grad_launch(151936, 2, true, 80, cluster).cluster, 0);
  EXPECT_EQ(grad_launch(151936, 2, true, 90, GradForce::kTwoPass).cluster, 0);
  EXPECT_EQ(grad_launch(151936, 2, true, 90, GradForce::kAuto).cluster,
            detail::lce::kClusterAuto ? 4 : 0);
  EXPECT_EQ(grad_launch(1000, 2, true, 90, GradForce::kAuto).cluster, 0);  // a row that stays in L2
  EXPECT_EQ(grad_launch(0, 2, true, 90, cluster).cluster, 0);
}

TEST(LinearCrossEntropyCpu, BadInputNamesTheProblem) {
  std::vector<float> z(12), rs(3), loss(3);
  std::vector<int64_t> y = {0, 5, 1};
  std::vector<bf16> g(12);
  TensorView zv = host_view(z.data(), DType::kFloat32, {3, 4}), yv = host_view(y.data(), DType::kInt64, {3});
  TensorView rv = host_view(rs.data(), DType::kFloat32, {3}), lv = host_view(loss.data(), DType::kFloat32, {3});
  TensorView gv = host_view(g.data(), DType::kBFloat16, {3, 4});
  expect_error([&] { linear_cross_entropy_logits_grad(zv, yv, rv, -100, 0, 0, 0, lv, gv, nullptr); },
               "linear_cross_entropy_logits_grad: labels[1] = 5: expected a class in [0, 4) or ignore_index -100");
  y[1] = 2;
  std::vector<double> zd(12);
  std::vector<bf16> zb(12);
  std::vector<float> gf(12);
  expect_error([&] {
    linear_cross_entropy_logits_grad(host_view(zd.data(), DType::kFloat64, {3, 4}), yv, rv, -100, 0, 0, 0, lv, gv,
                                     nullptr);
  }, "linear_cross_entropy_logits_grad: z: expected dtype float32, bfloat16 or float16, got float64");
  expect_error([&] {
    TensorView gfv = host_view(gf.data(), DType::kFloat32, {3, 4});
    linear_cross_entropy_logits_grad(host_view(zb.data(), DType::kBFloat16, {3, 4}), yv, rv, -100, 0, 0, 0, lv, gfv,
                                     nullptr);
  }, "linear_cross_entropy_logits_grad: g: expected dtype bfloat16 (that of z; any with float32 z), got float32");
  expect_error([&] { linear_cross_entropy_logits_grad(zv, yv, rv, -100, 1.0f, 0, 0, lv, gv, nullptr); },
               "expected 0 <= label_smoothing < 1");
  expect_error([&] {
    TensorView over = host_view(z.data(), DType::kFloat32, {3});
    linear_cross_entropy_logits_grad(zv, yv, rv, -100, 0, 0, 0, over, gv, nullptr);
  }, "linear_cross_entropy_logits_grad: loss overlaps z");
  TensorView none;
  linear_cross_entropy_logits_grad(zv, yv, rv, -100, 0, 0, 0, lv, none, nullptr);  // the loss alone
}

#ifdef MMFUSE_WITH_CUDA
// Each kernel (MMFUSE_LCE_GRAD): the two-pass one, and the one-read one on every 16-byte shape.
TEST(LinearCrossEntropyCuda, LogitsGradAgainstFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  struct Restore {
    ~Restore() { set_path_override("MMFUSE_LCE_GRAD", ""); }
  } restore;
  for (const char* path : {"two", "cluster"}) {
    SCOPED_TRACE(path);
    set_path_override("MMFUSE_LCE_GRAD", path);
    all_cases<bf16>(true);
    all_cases<f16>(true);
    all_cases<float>(true);
    all_cases<bf16, bf16>(true);
    all_cases<f16, f16>(true);
  }
}
#endif
