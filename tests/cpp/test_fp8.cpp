// FP8 building blocks: the host conversion against every code, the CPU quantize against its
// definition (nearest representable value, saturation, padding, history), the CPU GEMM against a
// float64 sum of the decoded values, CUDA against CPU (quantize bitwise, GEMM within fp32 rounding),
// and bad input naming the argument.
#include <algorithm>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "mmfuse/fp8.h"
#include "mmfuse/swiglu.h"
#include "test_util.h"

using namespace mmfuse;
using namespace mmfuse::test;

namespace {

TEST(Fp8Convert, EveryCodeRoundTripsAndTiesGoToEven) {
  for (bool e4m3 : {true, false}) {
    const int max_code = e4m3 ? 0x7e : 0x7b;
    for (int c = 0; c <= max_code; ++c) {
      for (uint8_t sign : {uint8_t(0), uint8_t(0x80)}) {
        const uint8_t code = uint8_t(c | sign);
        const float v = fp8_to_float(code, e4m3);
        EXPECT_EQ(float_to_fp8(v, e4m3), code) << "e4m3=" << e4m3 << " code " << c;
        if (c < max_code) {  // the midpoint to the next code rounds to the even one of the two
          const float next = fp8_to_float(uint8_t(code + 1), e4m3);
          const float mid = float((double(v) + double(next)) / 2);
          const uint8_t even = (c % 2 == 0) ? code : uint8_t(code + 1);
          EXPECT_EQ(float_to_fp8(mid, e4m3), even) << "e4m3=" << e4m3 << " midpoint after code " << c;
        }
      }
    }
    const float fmax = e4m3 ? 448.0f : 57344.0f;
    EXPECT_EQ(fp8_to_float(uint8_t(max_code), e4m3), fmax);
    for (float big : {fmax * 1.06f, 1e30f, INFINITY}) {  // saturation, never NaN or inf
      EXPECT_EQ(float_to_fp8(big, e4m3), max_code);
      EXPECT_EQ(float_to_fp8(-big, e4m3), max_code | 0x80);
    }
    EXPECT_EQ(float_to_fp8(1e-30f, e4m3), 0);
    EXPECT_TRUE(std::isnan(fp8_to_float(float_to_fp8(NAN, e4m3), e4m3)));
  }
}

struct Quant {
  std::vector<uint8_t> q, qt;
  std::vector<float> state;
  float scale_inv = NAN;
};

// Two quantizations of one tensor agree bitwise: scale, amax state, q and qt.
void expect_same_copies(const Quant& want, const Quant& got) {
  EXPECT_TRUE(bits_equal(want.scale_inv, got.scale_inv)) << want.scale_inv << " vs " << got.scale_inv;
  ASSERT_EQ(want.state.size(), got.state.size());
  for (size_t i = 0; i < want.state.size(); ++i) EXPECT_TRUE(bits_equal(want.state[i], got.state[i])) << "state " << i;
  EXPECT_EQ(want.q, got.q);
  EXPECT_EQ(want.qt, got.qt);
}

// Runs one quantize job over host views on the CPU, or on the GPU through device copies of every
// view given (outputs arrive poisoned as the host filled them) that are copied back afterwards.
void run_quantize(Fp8QuantJob& j, bool cuda) {
  if (!cuda) return fp8_quantize(&j, 1, nullptr);
#ifdef MMFUSE_WITH_CUDA
  TensorView* views[] = {&j.src,     &j.q,       &j.qt,       &j.scale_inv, &j.scale_inv_t, &j.state,
                         &j.scratch, &j.col_sums, &j.partials, &j.pack_q,    &j.pack_scale_inv};
  struct Copy {
    TensorView* v;
    void* host;
    void* dev;
    size_t bytes;
  };
  std::vector<Copy> copies;
  for (TensorView* v : views) {
    if (!v->defined()) continue;
    size_t span = v->numel() > 0 ? 1 : 0;  // elements the strides reach
    for (int d = 0; d < v->ndim && span; ++d) span += size_t((v->shape[d] - 1) * v->stride[d]);
    Copy c{v, v->data, nullptr, span * dtype_size(v->dtype)};
    ASSERT_EQ(cudaMalloc(&c.dev, std::max<size_t>(1, c.bytes)), cudaSuccess);
    if (c.bytes) ASSERT_EQ(cudaMemcpy(c.dev, c.host, c.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    v->data = c.dev;
    v->device = Device{DeviceType::kCUDA, 0};
    copies.push_back(c);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copies (legacy stream) done before st runs
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  fp8_quantize(&j, 1, st);
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  cudaStreamDestroy(st);
  for (const Copy& c : copies) {
    if (c.bytes) ASSERT_EQ(cudaMemcpy(c.host, c.dev, c.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(c.dev);
    c.v->data = c.host;
    c.v->device = Device{};
  }
#else
  FAIL() << "no CUDA in this build";
#endif
}

// Quantizes host x [r, c] (row stride ld; swiglu: the source [r, 2c] of swiglu(x)) on the CPU or
// through the GPU; state in/out.
template <class S>
void quantize(const std::vector<S>& x, int64_t r, int64_t c, int64_t ld, DType fmt, bool want_q, bool want_qt,
              bool dynamic, Quant& out, bool cuda, bool swiglu = false) {
  const int64_t cp = fp8_padded(c), rp = fp8_padded(r);
  out.q.assign(want_q ? size_t(rp * cp) : 0, 0xAB);  // poisoned
  out.qt.assign(want_qt ? size_t(cp * rp) : 0, 0xAB);
  Fp8QuantJob j;
  std::vector<int64_t> xs = {r, swiglu ? 2 * c : c}, xst = {ld, 1};
  j.src = host_view(const_cast<S*>(x.data()), dtype_of<S>(), xs, xst);
  j.swiglu = swiglu;
  if (want_q) j.q = host_view(out.q.data(), fmt, {rp, cp});
  if (want_qt) j.qt = host_view(out.qt.data(), fmt, {cp, rp});
  j.scale_inv = host_view(&out.scale_inv, DType::kFloat32, {1});
  j.state = host_view(out.state.data(), DType::kFloat32, {int64_t(out.state.size())});
  j.dynamic = dynamic;
  run_quantize(j, cuda);
}

// The CPU quantize against its definition.
template <class S>
void check_cpu_quantize(int64_t r, int64_t c, DType fmt, bool dynamic) {
  SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c << " fmt=" << dtype_name(fmt) << " dynamic=" << dynamic);
  std::mt19937_64 rng(test_seed() + uint64_t(r * 1000 + c));
  const int64_t ld = c + 3;
  std::vector<S> x = random_vec<S>(size_t(r * ld), rng, -3.0, 3.0);
  if (r * c > 0) x[size_t((r / 2) * ld + c / 2)] = from_double<S>(-37.5);  // an outlier sets amax
  double amax = 0;
  for (int64_t i = 0; i < r; ++i)
    for (int64_t k = 0; k < c; ++k) amax = std::max(amax, std::fabs(as_double(x[size_t(i * ld + k)])));
  Quant out;
  out.state = {10.0f, 2.0f, 0.0f, 0.0f};  // history of 2 (newest first), then scratch
  quantize(x, r, c, ld, fmt, true, true, dynamic, out, false);
  const bool e4m3 = fmt == DType::kFloat8E4M3;
  const float used = dynamic ? float(amax) : 10.0f;  // delayed: max of the history
  const float scale = fp8_max(fmt) / std::max(used, kFp8AmaxEps);
  EXPECT_EQ(out.scale_inv, 1.0f / scale);
  EXPECT_EQ(out.state[0], float(amax));
  EXPECT_EQ(out.state[1], 10.0f);  // the older entry moved down (the oldest, 2, dropped)
  EXPECT_EQ(out.state[2], 0.0f);
  EXPECT_EQ(out.state[3], 0.0f);
  const int64_t cp = fp8_padded(c), rp = fp8_padded(r);
  for (int64_t i = 0; i < rp; ++i) {
    for (int64_t k = 0; k < cp; ++k) {
      uint8_t code;
      if (i < r && k < c) {
        const float v = float(as_double(x[size_t(i * ld + k)])) * scale;
        code = out.q[size_t(i * cp + k)];
        const float got = fp8_to_float(code, e4m3);
        const float clamped = std::max(-fp8_max(fmt), std::min(fp8_max(fmt), v));
        // nearest: no neighbouring code is closer
        for (int d : {-1, 1}) {
          const int nb = (code & 0x7f) + d;
          if (nb < 0 || nb > (e4m3 ? 0x7e : 0x7b)) continue;
          const float other = fp8_to_float(uint8_t((code & 0x80) | nb), e4m3);
          ASSERT_LE(std::fabs(got - clamped), std::fabs(other - clamped)) << i << "," << k;
        }
      } else {
        code = 0;  // padding
        ASSERT_EQ(out.q[size_t(i * cp + k)], 0) << "q padding " << i << "," << k;
      }
      ASSERT_EQ(out.qt[size_t(k * rp + i)], code) << "qt " << k << "," << i;
    }
  }
}

TEST(Fp8QuantizeCpu, NearestSaturatedPaddedBothCopies) {
  for (DType fmt : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (bool dynamic : {true, false})
      for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {5, 7}, {16, 32}, {70, 130}, {3, 64}}) {
        check_cpu_quantize<bf16>(r, c, fmt, dynamic);
        check_cpu_quantize<float>(r, c, fmt, dynamic);
      }
  check_cpu_quantize<f16>(33, 17, DType::kFloat8E4M3, true);
}

TEST(Fp8QuantizeCpu, DelayedOnAFreshStateScalesLikeDynamic) {
  std::mt19937_64 rng(test_seed());
  std::vector<bf16> x = random_vec<bf16>(40 * 24, rng, -7.0, 7.0);
  Quant dyn, del;
  dyn.state = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  del.state = dyn.state;
  quantize(x, 40, 24, 24, DType::kFloat8E4M3, true, true, true, dyn, false);
  quantize(x, 40, 24, 24, DType::kFloat8E4M3, true, true, false, del, false);
  EXPECT_EQ(dyn.q, del.q);
  EXPECT_EQ(dyn.qt, del.qt);
  EXPECT_EQ(dyn.scale_inv, del.scale_inv);
  const float amax = dyn.state[0];
  EXPECT_GT(amax, 0.0f);
  EXPECT_EQ(del.state, (std::vector<float>{amax, amax, 0.0f, 0.0f, 0.0f}));  // the amax pass, then the cast
}

TEST(Fp8QuantizeCpu, ZerosGiveZerosAndFiniteScale) {
  std::vector<bf16> x(12 * 20, to_bf16(0.0f));
  Quant out;
  out.state = {0.0f, 0.0f, 0.0f};
  quantize(x, 12, 20, 20, DType::kFloat8E4M3, true, false, true, out, false);
  EXPECT_TRUE(std::isfinite(out.scale_inv));
  EXPECT_GT(out.scale_inv, 0.0f);
  for (uint8_t q : out.q) EXPECT_EQ(q, 0);
}

struct RowQuant {
  std::vector<uint8_t> q, qt;
  std::vector<float> si, si_t;
};

// Per-row quantize of host x [r, c] (both copies) on the CPU or through the GPU.
RowQuant quantize_rows(const std::vector<bf16>& x, int64_t r, int64_t c, bool cuda) {
  const int64_t rp = fp8_padded(r), cp = fp8_padded(c);
  RowQuant out;
  out.q.assign(size_t(rp * cp), 0xAB);
  out.qt.assign(size_t(cp * rp), 0xAB);
  out.si.assign(size_t(rp), NAN);
  out.si_t.assign(size_t(cp), NAN);
  std::vector<float> scratch(size_t(rp + cp), 0.0f);
  Fp8QuantJob j;
  j.src = host_view(const_cast<bf16*>(x.data()), DType::kBFloat16, {r, c});
  j.q = host_view(out.q.data(), DType::kFloat8E4M3, {rp, cp});
  j.qt = host_view(out.qt.data(), DType::kFloat8E4M3, {cp, rp});
  j.scale_inv = host_view(out.si.data(), DType::kFloat32, {rp});
  j.scale_inv_t = host_view(out.si_t.data(), DType::kFloat32, {cp});
  j.scratch = host_view(scratch.data(), DType::kFloat32, {rp + cp});
  j.per_row = true;
  run_quantize(j, cuda);
  return out;
}

// x [40, 24] bf16 with +Inf, -Inf and NaN at fixed places, and the same x with zeros there.
struct NonFinite {
  std::vector<bf16> x, zeroed;
  std::vector<std::pair<int64_t, int64_t>> at = {{3, 5}, {17, 0}, {39, 23}};
};
NonFinite non_finite_input() {
  std::mt19937_64 rng(test_seed() + 7);
  NonFinite n;
  n.x = random_vec<bf16>(40 * 24, rng, -6.0, 6.0);
  n.zeroed = n.x;
  const float bad[] = {INFINITY, -INFINITY, NAN};
  for (size_t i = 0; i < n.at.size(); ++i) {
    n.x[size_t(n.at[i].first * 24 + n.at[i].second)] = to_bf16(bad[i]);
    n.zeroed[size_t(n.at[i].first * 24 + n.at[i].second)] = to_bf16(0.0f);
  }
  return n;
}

// The non-finite rule: the scale (and the history) as if the bad elements were 0, those elements NaN,
// every other code unchanged; per tensor (dynamic and delayed) and per row.
TEST(Fp8QuantizeCpu, NonFiniteElementsBecomeNanAndLeaveTheScale) {
  const NonFinite n = non_finite_input();
  const int64_t cp = fp8_padded(24), rp = fp8_padded(40);
  for (DType fmt : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (bool dynamic : {true, false}) {
      SCOPED_TRACE(testing::Message() << dtype_name(fmt) << " dynamic=" << dynamic);
      const bool e4m3 = fmt == DType::kFloat8E4M3;
      Quant bad, ref;
      bad.state = ref.state = {0.0f, 2.0f, 0.0f, 0.0f};
      quantize(n.x, 40, 24, 24, fmt, true, true, dynamic, bad, false);
      quantize(n.zeroed, 40, 24, 24, fmt, true, true, dynamic, ref, false);
      EXPECT_TRUE(std::isfinite(bad.scale_inv));
      EXPECT_EQ(bad.scale_inv, ref.scale_inv);
      EXPECT_EQ(bad.state, ref.state);
      for (int64_t i = 0; i < 40; ++i)
        for (int64_t k = 0; k < 24; ++k) {
          const bool is_bad = std::find(n.at.begin(), n.at.end(), std::make_pair(i, k)) != n.at.end();
          const uint8_t q = bad.q[size_t(i * cp + k)], qt = bad.qt[size_t(k * rp + i)];
          EXPECT_EQ(q, qt);
          if (is_bad)
            EXPECT_TRUE(std::isnan(fp8_to_float(q, e4m3))) << i << "," << k;
          else
            EXPECT_EQ(q, ref.q[size_t(i * cp + k)]) << i << "," << k;
        }
    }
  const RowQuant bad = quantize_rows(n.x, 40, 24, false), ref = quantize_rows(n.zeroed, 40, 24, false);
  EXPECT_EQ(bad.si, ref.si);
  EXPECT_EQ(bad.si_t, ref.si_t);
  for (int64_t i = 0; i < 40; ++i)
    for (int64_t k = 0; k < 24; ++k) {
      const bool is_bad = std::find(n.at.begin(), n.at.end(), std::make_pair(i, k)) != n.at.end();
      const uint8_t q = bad.q[size_t(i * cp + k)];
      if (is_bad)
        EXPECT_TRUE(std::isnan(fp8_to_float(q, true))) << i << "," << k;
      else
        EXPECT_EQ(q, ref.q[size_t(i * cp + k)]) << i << "," << k;
    }
}

TEST(Fp8QuantizeCpu, PerRowScalesEachRowAndColumn) {
  std::mt19937_64 rng(test_seed());
  const int64_t r = 37, c = 21;
  std::vector<bf16> x = random_vec<bf16>(size_t(r * c), rng, -1.0, 1.0);
  for (int64_t i = 0; i < r; ++i)  // rows of very different ranges
    for (int64_t k = 0; k < c; ++k) x[size_t(i * c + k)] = to_bf16(to_float(x[size_t(i * c + k)]) * std::ldexp(1.0f, int(i % 9) - 4));
  for (int64_t k = 0; k < c; ++k) x[size_t(5 * c + k)] = to_bf16(0.0f);  // a zero row
  const RowQuant out = quantize_rows(x, r, c, false);
  const int64_t rp = fp8_padded(r), cp = fp8_padded(c);
  std::vector<float> ra(size_t(rp), 0.0f), ca(size_t(cp), 0.0f);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t k = 0; k < c; ++k) {
      ra[size_t(i)] = std::max(ra[size_t(i)], std::fabs(to_float(x[size_t(i * c + k)])));
      ca[size_t(k)] = std::max(ca[size_t(k)], std::fabs(to_float(x[size_t(i * c + k)])));
    }
  for (int64_t i = 0; i < rp; ++i) {
    const float s = 448.0f / std::max(ra[size_t(i)], kFp8AmaxEps);
    ASSERT_EQ(out.si[size_t(i)], 1.0f / s) << "row " << i;
    for (int64_t k = 0; k < cp; ++k) {
      const float v = i < r && k < c ? to_float(x[size_t(i * c + k)]) : 0.0f;
      ASSERT_EQ(out.q[size_t(i * cp + k)], float_to_fp8(v * s, true)) << i << "," << k;
      const float sc = 448.0f / std::max(ca[size_t(k)], kFp8AmaxEps);
      ASSERT_EQ(out.qt[size_t(k * rp + i)], float_to_fp8(v * sc, true)) << "qt " << k << "," << i;
      if (i == 0) ASSERT_EQ(out.si_t[size_t(k)], 1.0f / sc) << "column " << k;
    }
    if (i < r && ra[size_t(i)] > 0) {  // each row's largest value lands on +-448
      uint8_t top = 0;
      for (int64_t k = 0; k < c; ++k) top = std::max<uint8_t>(top, out.q[size_t(i * cp + k)] & 0x7f);
      ASSERT_EQ(top, 0x7e) << "row " << i;
    }
  }
}

// Column sums from the cast pass (the bias gradient): CPU against float64 here, CUDA against CPU below.
std::vector<float> col_sums_of(const std::vector<bf16>& x, int64_t r, int64_t c, bool per_row, bool cuda) {
  const int64_t rp = fp8_padded(r), cp = fp8_padded(c);
  std::vector<uint8_t> q(size_t(rp * cp)), qt(size_t(cp * rp));
  std::vector<float> si(per_row ? size_t(rp) : size_t(1)), sit(static_cast<size_t>(cp)), state{0.0f, 0.0f, 0.0f};
  std::vector<float> scratch(static_cast<size_t>(rp + cp));
  std::vector<float> sums(size_t(c), NAN);
  Fp8QuantJob j;
  j.src = host_view(const_cast<bf16*>(x.data()), DType::kBFloat16, {r, c});
  j.q = host_view(q.data(), DType::kFloat8E5M2, {rp, cp});
  j.qt = host_view(qt.data(), DType::kFloat8E5M2, {cp, rp});
  j.scale_inv = host_view(si.data(), DType::kFloat32, {int64_t(si.size())});
  j.per_row = per_row;
  if (per_row) {
    j.scale_inv_t = host_view(sit.data(), DType::kFloat32, {cp});
    j.scratch = host_view(scratch.data(), DType::kFloat32, {rp + cp});
  } else {
    j.state = host_view(state.data(), DType::kFloat32, {3});
  }
  j.col_sums = host_view(sums.data(), DType::kFloat32, {c});
  std::vector<float> partials(size_t(fp8_col_sum_partials(r, c)), NAN);  // the CUDA path's workspace
  j.partials = host_view(partials.data(), DType::kFloat32, {int64_t(partials.size())});
  run_quantize(j, cuda);
  return sums;
}

TEST(Fp8QuantizeCpu, ColumnSumsFromTheCast) {
  std::mt19937_64 rng(test_seed());
  for (bool per_row : {false, true}) {
    const int64_t r = 70, c = 45;
    std::vector<bf16> x = random_vec<bf16>(size_t(r * c), rng, -3.0, 3.0);
    const std::vector<float> got = col_sums_of(x, r, c, per_row, false);
    for (int64_t k = 0; k < c; ++k) {
      double ref = 0, mag = 0;
      for (int64_t i = 0; i < r; ++i) {
        ref += double(to_float(x[size_t(i * c + k)]));
        mag += std::fabs(double(to_float(x[size_t(i * c + k)])));
      }
      ASSERT_NEAR(got[size_t(k)], ref, 1e-6 * double(r) * mag) << "column " << k;
    }
  }
}

// A GEMM problem: a [m, k], b [n, k] fp8 (random codes of small values), checked against float64.
struct GemmCase {
  int64_t m, n, k;
  DType ta, tb, tout;
  bool bias, accumulate;
  bool per_row = false;  // vector scales: one per row of a and of b
};

std::vector<uint8_t> random_codes(size_t count, bool e4m3, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-6.0f, 6.0f);
  std::vector<uint8_t> v(count);
  for (auto& c : v) c = float_to_fp8(d(rng), e4m3);
  return v;
}

void run_gemm(const GemmCase& g, bool cuda) {
  SCOPED_TRACE(testing::Message() << g.m << "x" << g.n << "x" << g.k << " " << dtype_name(g.ta) << "*"
                                  << dtype_name(g.tb) << "->" << dtype_name(g.tout) << " bias=" << g.bias
                                  << " acc=" << g.accumulate << " cuda=" << cuda);
  std::mt19937_64 rng(test_seed() + uint64_t(g.m * 7 + g.n * 13 + g.k));
  const bool a43 = g.ta == DType::kFloat8E4M3, b43 = g.tb == DType::kFloat8E4M3;
  std::vector<uint8_t> a = random_codes(size_t(g.m * g.k), a43, rng), b = random_codes(size_t(g.n * g.k), b43, rng);
  std::vector<bf16> bias = random_vec<bf16>(size_t(g.n), rng);
  const int64_t ldo = g.n;
  // scales: scalars, or per row powers of two times a constant
  std::vector<float> sav_h(g.per_row ? size_t(std::max<int64_t>(1, g.m)) : 1, 0.375f);
  std::vector<float> sbv_h(g.per_row ? size_t(g.n) : 1, 1.0f / 1024.0f);
  for (size_t i = 0; g.per_row && i < sav_h.size(); ++i) sav_h[i] = std::ldexp(0.375f, int(i % 7) - 3);
  for (size_t j = 0; g.per_row && j < sbv_h.size(); ++j) sbv_h[j] = std::ldexp(1.0f / 1024.0f, int(j % 5) - 2);
  auto sa_at = [&](int64_t i) { return double(sav_h[g.per_row ? size_t(i) : 0]); };
  auto sb_at = [&](int64_t j) { return double(sbv_h[g.per_row ? size_t(j) : 0]); };
  std::vector<float> prior = random_vec<float>(size_t(g.m * ldo), rng);
  std::vector<float> out32 = prior;
  std::vector<bf16> out16(size_t(g.m * ldo));
  if (!g.accumulate) {
    poison(out32);
    poison(out16);
  }
  Fp8GemmOptions o;
  o.accumulate = g.accumulate;
  o.fast_accum = !g.accumulate;
  const bool f32 = g.tout == DType::kFloat32;
  TensorView av = host_view(a.data(), g.ta, {g.m, g.k}), bv = host_view(b.data(), g.tb, {g.n, g.k});
  TensorView sav = host_view(sav_h.data(), DType::kFloat32, {int64_t(sav_h.size())});
  TensorView sbv = host_view(sbv_h.data(), DType::kFloat32, {int64_t(sbv_h.size())});
  TensorView biasv = g.bias ? host_view(bias.data(), DType::kBFloat16, {g.n}) : TensorView{};
  TensorView ov = host_view(f32 ? static_cast<void*>(out32.data()) : static_cast<void*>(out16.data()), g.tout,
                            {g.m, g.n}, {ldo, 1});
  if (!cuda) {
    TensorView none;
    fp8_gemm(av, bv, sav, sbv, biasv, ov, o, none, nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    DeviceBuffer<uint8_t> da(a), db(b), ws{static_cast<size_t>(fp8_gemm_workspace_bytes())};
    DeviceBuffer<bf16> dbias(bias), do16(out16);
    DeviceBuffer<float> dsa(sav_h), dsb(sbv_h), do32(out32);
    auto dv = [](TensorView v, void* p) {
      v.data = p;
      v.device = Device{DeviceType::kCUDA, 0};
      return v;
    };
    TensorView cav = dv(av, da.ptr), cbv = dv(bv, db.ptr), csa = dv(sav, dsa.ptr), csb = dv(sbv, dsb.ptr);
    TensorView cbias = g.bias ? dv(biasv, dbias.ptr) : TensorView{};
    TensorView cov = dv(ov, f32 ? static_cast<void*>(do32.ptr) : static_cast<void*>(do16.ptr));
    TensorView cws = device_view(ws.ptr, DType::kUInt8, {int64_t(ws.n)});
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    fp8_gemm(cav, cbv, csa, csb, cbias, cov, o, cws, s);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaStreamDestroy(s);
    out32 = do32.download();
    out16 = do16.download();
#else
    FAIL() << "no CUDA in this build";
#endif
  }
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t kk = 0; kk < g.k; ++kk) {
        const double p = double(fp8_to_float(a[size_t(i * g.k + kk)], a43)) * fp8_to_float(b[size_t(j * g.k + kk)], b43);
        ref += p;
        mag += std::fabs(p);
      }
      ref *= sa_at(i) * sb_at(j);
      mag *= sa_at(i) * sb_at(j);
      if (g.bias) ref += double(to_float(bias[size_t(j)]));
      if (g.accumulate) ref += double(prior[size_t(i * ldo + j)]);
      const double got = f32 ? double(out32[size_t(i * ldo + j)]) : double(to_float(out16[size_t(i * ldo + j)]));
      // fp32 accumulation (~k ulps of the magnitude; the tensor cores' fast fp8 accumulation keeps
      // fewer bits) plus the output's own rounding
      const double acc_tol = cuda && o.fast_accum ? 1e-3 : 1e-6 * double(g.k + 4);
      const double tol = acc_tol * (mag + 1.0) + (f32 ? 0.0 : std::fabs(ref) * 0x1p-8);
      ASSERT_NEAR(got, ref, tol) << "out[" << i << ", " << j << "]";
    }
  }
}

std::vector<GemmCase> gemm_cases() {
  const DType e4 = DType::kFloat8E4M3, e5 = DType::kFloat8E5M2, b16 = DType::kBFloat16, f32 = DType::kFloat32;
  return {{33, 48, 64, e4, e4, b16, true, false, true}, {20, 32, 48, e5, e4, f32, false, true, true},
          {1, 16, 16, e4, e4, b16, false, false},  {7, 48, 48, e4, e4, b16, true, false},
          {64, 48, 128, e5, e4, b16, false, false}, {19, 16, 32, e4, e5, f32, false, false},
          {40, 32, 64, e5, e4, f32, false, true},  {0, 16, 16, e4, e4, b16, false, false},
          {5, 16, 0, e4, e4, f32, false, true},     {130, 80, 272, e4, e4, b16, true, false}};
}

TEST(Fp8GemmCpu, MatchesFloat64) {
  for (const auto& g : gemm_cases()) run_gemm(g, false);
}

TEST(Fp8Errors, NameTheArgument) {
  std::vector<bf16> x(4 * 8);
  std::vector<uint8_t> q(16 * 16), wrong(4 * 8);
  std::vector<float> st(3), si(1), small(2);
  Fp8QuantJob j;
  j.src = host_view(x.data(), DType::kBFloat16, {4, 8});
  j.q = host_view(q.data(), DType::kFloat8E4M3, {16, 16});
  j.scale_inv = host_view(si.data(), DType::kFloat32, {1});
  j.state = host_view(st.data(), DType::kFloat32, {3});
  Fp8QuantJob bad = j;
  bad.q = host_view(wrong.data(), DType::kFloat8E4M3, {4, 8});
  expect_error([&] { fp8_quantize(&bad, 1, nullptr); }, "q: expected shape [16, 16]");
  bad = j;
  bad.q.dtype = DType::kUInt8;
  expect_error([&] { fp8_quantize(&bad, 1, nullptr); }, "q: expected dtype float8_e4m3fn or float8_e5m2");
  bad = j;
  bad.state = host_view(small.data(), DType::kFloat32, {2});
  expect_error([&] { fp8_quantize(&bad, 1, nullptr); }, "state: expected a contiguous float32 [history + 2]");
  bad = j;
  bad.src.dtype = DType::kInt32;
  expect_error([&] { fp8_quantize(&bad, 1, nullptr); }, "x: expected dtype bfloat16, float16 or float32, got int32");
  bad = j;
  bad.q = TensorView{};
  expect_error([&] { fp8_quantize(&bad, 1, nullptr); }, "expected q, qt or both");
  expect_error([&] { fp8_quantize(&j, 3, nullptr); }, "expected 1 or 2 tensors, got 3");

  std::vector<uint8_t> a(4 * 16), b(16 * 16);
  std::vector<float> out(4 * 16), sc(2, 1.0f);
  TensorView av = host_view(a.data(), DType::kFloat8E5M2, {4, 16}), bv = host_view(b.data(), DType::kFloat8E5M2, {16, 16});
  TensorView s0 = host_view(&sc[0], DType::kFloat32, {1}), s1 = host_view(&sc[1], DType::kFloat32, {1});
  TensorView ov = host_view(out.data(), DType::kFloat32, {4, 16}), none;
  Fp8GemmOptions o;
  expect_error([&] { fp8_gemm(av, bv, s0, s1, none, ov, o, none, nullptr); }, "at most one of them may be float8_e5m2");
  av.dtype = DType::kFloat8E4M3;
  TensorView b12 = host_view(b.data(), DType::kFloat8E4M3, {16, 12});
  expect_error([&] { fp8_gemm(av, b12, s0, s1, none, ov, o, none, nullptr); }, "b: expected k (its columns) a multiple of 16");
  TensorView b8 = host_view(b.data(), DType::kFloat8E4M3, {8, 16});
  expect_error([&] { fp8_gemm(av, b8, s0, s1, none, ov, o, none, nullptr); }, "b: expected n (its rows) a multiple of 16");
  TensorView ov5 = host_view(out.data(), DType::kFloat32, {4, 5}, {16, 1});
  expect_error([&] { fp8_gemm(av, bv, s0, s1, none, ov5, o, none, nullptr); }, "out: expected shape [4, 16], got [4, 5]");
  TensorView odd = host_view(out.data(), DType::kFloat32, {2, 16}, {32, 1});
  expect_error([&] { fp8_gemm(host_view(a.data(), DType::kFloat8E4M3, {2, 16}), bv, s0, s1, none, odd, o, none, nullptr); },
               "out: expected a contiguous tensor");
  TensorView bias = host_view(out.data(), DType::kFloat32, {16});
  expect_error([&] { fp8_gemm(av, bv, s0, s1, bias, ov, o, none, nullptr); }, "bias: only with a bfloat16 out");
}

// The swiglu source against the swiglu op's output quantized as a plain tensor: q, qt, scale_inv and
// the state bitwise (on the CPU, or both on the GPU), for odd sizes, padded rows, each dtype, both
// formats, dynamic and delayed, fresh and used states.
template <class S>
void check_swiglu_source(int64_t r, int64_t c, int64_t pad, DType fmt, bool dynamic, bool fresh, bool cuda) {
  SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c << " pad=" << pad << " fmt=" << dtype_name(fmt)
                                  << " dynamic=" << dynamic << " fresh=" << fresh << " cuda=" << cuda);
  std::mt19937_64 rng(test_seed() + uint64_t(r * 131 + c * 7 + pad));
  const int64_t ld = 2 * c + pad;
  std::vector<S> gu = random_vec<S>(size_t(std::max<int64_t>(1, r * ld)), rng, -6.0, 6.0);
  std::vector<S> y(size_t(std::max<int64_t>(1, r * c)));
  poison(y);
  TensorView guv = host_view(gu.data(), dtype_of<S>(), {r, 2 * c}, {ld, 1});
  if (!cuda) {
    TensorView yv = host_view(y.data(), dtype_of<S>(), {r, c});
    swiglu(guv, yv, nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    DeviceBuffer<S> dg(gu), dy(y);
    Stream st;
    TensorView yv = device_view(dy.ptr, dtype_of<S>(), {r, c});
    swiglu(device_view(dg.ptr, dtype_of<S>(), {r, 2 * c}, {ld, 1}), yv, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    y = dy.download();
#endif
  }
  Quant plain, fused;
  plain.state = fused.state = fresh ? std::vector<float>(5, 0.0f) : std::vector<float>{3.0f, 9.0f, 0.5f, 0.0f, 0.0f};
  quantize(y, r, c, c, fmt, true, true, dynamic, plain, cuda);
  quantize(gu, r, c, ld, fmt, true, true, dynamic, fused, cuda, true);
  expect_same_copies(plain, fused);
}

void swiglu_source_cases(bool cuda) {
  for (DType fmt : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (bool dynamic : {true, false})
      for (bool fresh : {true, false})
        for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {5, 7}, {64, 64}, {130, 200}, {257, 72}, {0, 16},
                            {9, 0}}) {
          check_swiglu_source<bf16>(r, c, 0, fmt, dynamic, fresh, cuda);
          check_swiglu_source<bf16>(r, c, 8, fmt, dynamic, fresh, cuda);
          check_swiglu_source<f16>(r, c, 3, fmt, dynamic, fresh, cuda);
          check_swiglu_source<float>(r, c, 0, fmt, dynamic, fresh, cuda);
        }
}

TEST(Fp8QuantizeCpu, SwigluSourceEqualsTheSwigluOutputQuantized) { swiglu_source_cases(false); }

// The swiglu_grad source (dy [r, c] and a pack of gate_up [r, 2c]) against swiglu_backward_fp8's output
// [r, 2c] quantized as a plain tensor on the CPU: q, qt, scale_inv and the state bitwise (the source on
// the CPU, or on the GPU), for odd sizes (c not a multiple of 16: a run across the gate / up halves),
// strided dy and pack rows, each dtype, both formats, dynamic and delayed, fresh and used states, each
// copy alone (q alone: on the GPU, one read of the sources for both halves) and both.
template <class S>
void check_swiglu_grad_source(int64_t r, int64_t c, int64_t pad, DType fmt, bool dynamic, bool fresh, bool cuda,
                              bool want_q = true, bool want_qt = true) {
  SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c << " pad=" << pad << " fmt=" << dtype_name(fmt)
                                  << " dynamic=" << dynamic << " fresh=" << fresh << " cuda=" << cuda
                                  << " q=" << want_q << " qt=" << want_qt);
  std::mt19937_64 rng(test_seed() + uint64_t(r * 313 + c * 5 + pad));
  const int64_t c2 = 2 * c, tiles = swiglu_pack_tiles(c2);
  const int64_t ldd = std::max<int64_t>(1, c + pad), ldq = std::max<int64_t>(1, c2 + 2 * pad);
  const int64_t lds = std::max<int64_t>(1, tiles + pad);
  std::vector<S> gu = random_vec<S>(size_t(std::max<int64_t>(1, r * c2)), rng, -6.0, 6.0);
  for (int64_t i = 0; i < r; ++i)  // tiles of many magnitudes: the pack's scales differ
    for (int64_t k = 0; k < c2; ++k)
      gu[size_t(i * c2 + k)] = from_double<S>(as_double(gu[size_t(i * c2 + k)]) * std::ldexp(1.0, int((i + k / 128) % 9) - 4));
  std::vector<uint8_t> pq(size_t(std::max<int64_t>(1, r * ldq)), 0xAB);
  std::vector<float> ps(size_t(std::max<int64_t>(1, r * lds)), NAN);
  TensorView pqv = host_view(pq.data(), DType::kFloat8E4M3, {r, c2}, {ldq, 1});
  TensorView psv = host_view(ps.data(), DType::kFloat32, {r, tiles}, {lds, 1});
  swiglu_pack_fp8(host_view(gu.data(), dtype_of<S>(), {r, c2}), pqv, psv, nullptr);
  std::vector<S> dy = random_vec<S>(size_t(std::max<int64_t>(1, r * ldd)), rng, -3.0, 3.0);
  std::vector<S> dgu(size_t(std::max<int64_t>(1, r * c2)));
  poison(dgu);
  TensorView dgv = host_view(dgu.data(), dtype_of<S>(), {r, c2}), none;
  swiglu_backward_fp8(host_view(dy.data(), dtype_of<S>(), {r, c}, {ldd, 1}), pqv, psv, dgv, none, nullptr);
  Quant plain, fused;
  plain.state = fused.state = fresh ? std::vector<float>(5, 0.0f) : std::vector<float>{3.0f, 9.0f, 0.5f, 0.0f, 0.0f};
  quantize(dgu, r, c2, c2, fmt, want_q, want_qt, dynamic, plain, false);
  const int64_t cp = fp8_padded(c2), rp = fp8_padded(r);
  fused.q.assign(want_q ? size_t(rp * cp) : 0, 0xAB);
  fused.qt.assign(want_qt ? size_t(cp * rp) : 0, 0xAB);
  Fp8QuantJob j;
  j.src = host_view(dy.data(), dtype_of<S>(), {r, c}, {ldd, 1});
  j.swiglu_grad = true;
  j.pack_q = pqv;
  j.pack_scale_inv = psv;
  if (want_q) j.q = host_view(fused.q.data(), fmt, {rp, cp});
  if (want_qt) j.qt = host_view(fused.qt.data(), fmt, {cp, rp});
  j.scale_inv = host_view(&fused.scale_inv, DType::kFloat32, {1});
  j.state = host_view(fused.state.data(), DType::kFloat32, {5});
  j.dynamic = dynamic;
  run_quantize(j, cuda);
  expect_same_copies(plain, fused);
}

void swiglu_grad_source_cases(bool cuda) {
  for (DType fmt : {DType::kFloat8E5M2, DType::kFloat8E4M3})
    for (bool dynamic : {true, false})
      for (bool fresh : {true, false})
        for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {5, 7}, {64, 64}, {130, 200}, {257, 72}, {33, 136},
                            {0, 16}, {9, 0}}) {
          check_swiglu_grad_source<bf16>(r, c, 0, fmt, dynamic, fresh, cuda);
          check_swiglu_grad_source<bf16>(r, c, 16, fmt, dynamic, fresh, cuda);
          check_swiglu_grad_source<bf16>(r, c, 0, fmt, dynamic, fresh, cuda, true, false);
          check_swiglu_grad_source<bf16>(r, c, 16, fmt, dynamic, fresh, cuda, true, false);
          check_swiglu_grad_source<f16>(r, c, 0, fmt, dynamic, fresh, cuda, false, true);
          check_swiglu_grad_source<f16>(r, c, 3, fmt, dynamic, fresh, cuda);
          check_swiglu_grad_source<float>(r, c, 0, fmt, dynamic, fresh, cuda);
        }
}

TEST(Fp8QuantizeCpu, SwigluGradSourceEqualsTheSwigluGradientQuantized) { swiglu_grad_source_cases(false); }

// fp8_transpose against its definition on the CPU, or through the GPU (bitwise), for square, wide,
// tall and tile-straddling padded shapes; the output poisoned first.
void check_transpose(int64_t r, int64_t c, bool cuda) {
  SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c << " cuda=" << cuda);
  std::mt19937_64 rng(test_seed() + uint64_t(r * 7 + c));
  std::vector<uint8_t> q(size_t(r * c)), qt(size_t(r * c), 0xAB);
  for (auto& b : q) b = uint8_t(rng());
  if (!cuda) {
    TensorView out = host_view(qt.data(), DType::kFloat8E5M2, {c, r});
    fp8_transpose(host_view(q.data(), DType::kFloat8E5M2, {r, c}), out, nullptr);
  } else {
#ifdef MMFUSE_WITH_CUDA
    DeviceBuffer<uint8_t> dq(q), dqt(qt);
    Stream st;
    TensorView out = device_view(dqt.ptr, DType::kFloat8E5M2, {c, r});
    fp8_transpose(device_view(dq.ptr, DType::kFloat8E5M2, {r, c}), out, st.s);
    ASSERT_EQ(cudaStreamSynchronize(st.s), cudaSuccess);
    qt = dqt.download();
#endif
  }
  for (int64_t i = 0; i < r; ++i)
    for (int64_t k = 0; k < c; ++k) ASSERT_EQ(qt[size_t(k * r + i)], q[size_t(i * c + k)]) << i << "," << k;
}

void transpose_cases(bool cuda) {
  for (auto [r, c] : {std::pair<int64_t, int64_t>{16, 16}, {48, 160}, {160, 48}, {1040, 2064}, {64, 64}, {0, 32}})
    check_transpose(r, c, cuda);
}

TEST(Fp8TransposeCpu, EqualsTheDefinition) { transpose_cases(false); }

TEST(Fp8Errors, TransposeNamesTheProblem) {
  std::vector<uint8_t> q(32 * 48), qt(32 * 48);
  TensorView out = host_view(qt.data(), DType::kFloat8E5M2, {48, 32});
  expect_error([&] { fp8_transpose(host_view(q.data(), DType::kFloat8E5M2, {30, 48}), out, nullptr); },
               "q: expected both dims multiples of 16 (a padded copy), got [30, 48]");
  expect_error([&] { fp8_transpose(host_view(q.data(), DType::kFloat8E4M3, {32, 48}), out, nullptr); },
               "qt: expected q's dtype float8_e4m3fn, got float8_e5m2");
  std::vector<bf16> b(32 * 48);
  expect_error([&] { fp8_transpose(host_view(b.data(), DType::kBFloat16, {32, 48}), out, nullptr); },
               "q: expected dtype float8_e4m3fn or float8_e5m2, got bfloat16");
  TensorView bad = host_view(qt.data(), DType::kFloat8E5M2, {32, 48});
  expect_error([&] { fp8_transpose(host_view(q.data(), DType::kFloat8E5M2, {32, 48}), bad, nullptr); },
               "qt: expected shape [48, 32], got [32, 48]");
  TensorView same = host_view(q.data(), DType::kFloat8E5M2, {48, 32});
  expect_error([&] { fp8_transpose(host_view(q.data(), DType::kFloat8E5M2, {32, 48}), same, nullptr); },
               "qt overlaps q");
}

TEST(Fp8Errors, SwigluGradSourceNamesTheProblem) {
  std::vector<bf16> dy(4 * 8);
  std::vector<uint8_t> q(16 * 16), pq(4 * 16);
  std::vector<float> st(3), si(1), ps(4), rows(16), scratch(32);
  Fp8QuantJob j;
  j.src = host_view(dy.data(), DType::kBFloat16, {4, 8});
  j.q = host_view(q.data(), DType::kFloat8E5M2, {16, 16});
  j.scale_inv = host_view(si.data(), DType::kFloat32, {1});
  j.state = host_view(st.data(), DType::kFloat32, {3});
  j.swiglu_grad = true;
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "pack_q is missing");
  j.pack_q = host_view(pq.data(), DType::kFloat8E4M3, {4, 14});
  j.pack_scale_inv = host_view(ps.data(), DType::kFloat32, {4, 1});
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "pack_q: expected float8_e4m3fn [4, 16] (swiglu_pack_fp8 of the [gate | up] tensor: twice x");
  j.pack_q = host_view(pq.data(), DType::kFloat8E4M3, {4, 16});
  j.pack_scale_inv = host_view(ps.data(), DType::kFloat32, {2, 2});
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "pack_scale_inv: expected float32 [4, 1] with a contiguous");
  j.pack_scale_inv = host_view(ps.data(), DType::kFloat32, {4, 1});
  j.swiglu = true;
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "swiglu and swiglu_grad: expected one source kind, got both");
  j.swiglu = false;
  j.per_row = true;
  j.scale_inv = host_view(rows.data(), DType::kFloat32, {16});
  j.scratch = host_view(scratch.data(), DType::kFloat32, {32});
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "swiglu_grad: per tensor scaling only");
}

TEST(Fp8Errors, SwigluSourceNamesTheProblem) {
  std::vector<bf16> x(4 * 9);
  std::vector<uint8_t> q(16 * 16);
  std::vector<float> st(3), si(1), rows(16), scratch(32);
  Fp8QuantJob j;
  j.src = host_view(x.data(), DType::kBFloat16, {4, 9});
  j.q = host_view(q.data(), DType::kFloat8E4M3, {16, 16});
  j.scale_inv = host_view(si.data(), DType::kFloat32, {1});
  j.state = host_view(st.data(), DType::kFloat32, {3});
  j.swiglu = true;
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "x: swiglu: expected the [gate | up] layout (an even number");
  j.src = host_view(x.data(), DType::kBFloat16, {4, 8});
  j.per_row = true;
  j.scale_inv = host_view(rows.data(), DType::kFloat32, {16});
  j.scratch = host_view(scratch.data(), DType::kFloat32, {32});
  expect_error([&] { fp8_quantize(&j, 1, nullptr); }, "swiglu: per tensor scaling only");
}

#ifdef MMFUSE_WITH_CUDA
// CUDA against CPU: q, qt, scale_inv and the state bitwise, for odd and aligned shapes, each source
// dtype, both formats, dynamic and delayed, strided rows.
template <class S>
void check_cuda_quantize(int64_t r, int64_t c, int64_t ld, DType fmt, bool dynamic, bool want_q, bool want_qt,
                         bool fresh = false) {
  SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c << " ld=" << ld << " fmt=" << dtype_name(fmt)
                                  << " dynamic=" << dynamic << " q=" << want_q << " qt=" << want_qt);
  std::mt19937_64 rng(test_seed() + uint64_t(r * 977 + c * 3 + ld));
  std::vector<S> x = random_vec<S>(size_t(std::max<int64_t>(1, r * ld)), rng, -50.0, 50.0);
  Quant cpu, gpu;
  cpu.state = gpu.state = fresh ? std::vector<float>(5, 0.0f) : std::vector<float>{3.0f, 90.0f, 7.0f, 0.0f, 0.0f};
  quantize(x, r, c, ld, fmt, want_q, want_qt, dynamic, cpu, false);
  quantize(x, r, c, ld, fmt, want_q, want_qt, dynamic, gpu, true);
  expect_same_copies(cpu, gpu);
}

TEST(Fp8QuantizeCuda, BitwiseEqualToCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  for (DType fmt : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (bool dynamic : {true, false})
      for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {5, 7}, {64, 64}, {100, 200}, {257, 72}, {130, 390},
                          {0, 16}, {9, 0}}) {
        check_cuda_quantize<bf16>(r, c, c, fmt, dynamic, true, true);
        check_cuda_quantize<bf16>(r, c, c + 8, fmt, dynamic, true, false);
        check_cuda_quantize<f16>(r, c, c + 1, fmt, dynamic, false, true);
        check_cuda_quantize<float>(r, c, c, fmt, dynamic, true, true);
      }
  check_cuda_quantize<bf16>(4096, 1000, 1000, DType::kFloat8E4M3, false, true, true);  // many blocks a job
  for (bool dynamic : {true, false})  // a fresh state: delayed scaling runs the amax pass first
    for (auto [r, c] : {std::pair<int64_t, int64_t>{5, 7}, {300, 136}, {0, 16}})
      check_cuda_quantize<bf16>(r, c, c, DType::kFloat8E4M3, dynamic, true, true, true);
}

TEST(Fp8QuantizeCuda, SwigluSourceEqualsTheSwigluOutputQuantized) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  swiglu_source_cases(true);
  check_swiglu_source<bf16>(4096, 1000, 0, DType::kFloat8E4M3, false, false, true);  // many blocks
}

TEST(Fp8TransposeCuda, BitwiseEqualToTheDefinition) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  transpose_cases(true);
  check_transpose(15360, 2752, true);  // many tiles a block
}

TEST(Fp8QuantizeCuda, SwigluGradSourceEqualsTheSwigluGradientQuantized) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  swiglu_grad_source_cases(true);
  for (bool want_qt : {true, false}) {  // many blocks
    check_swiglu_grad_source<bf16>(2048, 1376, 0, DType::kFloat8E5M2, false, false, true, true, want_qt);
    check_swiglu_grad_source<bf16>(1000, 1000, 8, DType::kFloat8E5M2, true, false, true, true, want_qt);
    check_swiglu_grad_source<float>(300, 2048, 0, DType::kFloat8E5M2, false, true, true, true, want_qt);
  }
}

// Delayed scaling over a run of calls, as a training loop makes them: the history shifts, the scale
// follows its maximum (values past it saturate), the scratch words end at zero; every call's copies,
// scale and state bitwise equal to the CPU's, for amaxes that grow and shrink, both formats, plain
// and swiglu sources, grids of many blocks.
TEST(Fp8QuantizeCuda, DelayedHistoryOverManyCallsBitwiseEqualToCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  const int64_t r = 2000, c = 1000;
  for (DType fmt : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (bool swiglu : {false, true}) {
      Quant cpu, gpu;
      cpu.state = gpu.state = std::vector<float>(4 + 2, 0.0f);  // a fresh history of 4
      std::mt19937_64 rng(test_seed() + (swiglu ? 7u : 0u));
      int call = 0;
      for (double amp : {1.0, 1.5, 0.5, 3.0, 3.2, 0.1, 0.1, 2.0, 1.0}) {
        SCOPED_TRACE(testing::Message() << dtype_name(fmt) << " swiglu=" << swiglu << " call " << call++);
        const int64_t ld = swiglu ? 2 * c : c;
        std::vector<bf16> x = random_vec<bf16>(size_t(r * ld), rng, -amp, amp);
        quantize(x, r, c, ld, fmt, true, true, false, cpu, false, swiglu);
        quantize(x, r, c, ld, fmt, true, true, false, gpu, true, swiglu);
        ASSERT_TRUE(bits_equal(cpu.scale_inv, gpu.scale_inv)) << cpu.scale_inv << " vs " << gpu.scale_inv;
        ASSERT_EQ(cpu.state, gpu.state);
        ASSERT_EQ(gpu.state[4], 0.0f);  // the scratch: running maximum and block counter back to zero
        ASSERT_EQ(gpu.state[5], 0.0f);
        ASSERT_EQ(cpu.q, gpu.q);
        ASSERT_EQ(cpu.qt, gpu.qt);
      }
    }
}

TEST(Fp8QuantizeCuda, NonFiniteBitwiseEqualToCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  const NonFinite n = non_finite_input();
  for (DType fmt : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (bool dynamic : {true, false})
      for (bool fresh : {true, false}) {
        SCOPED_TRACE(testing::Message() << dtype_name(fmt) << " dynamic=" << dynamic << " fresh=" << fresh);
        Quant cpu, gpu;
        cpu.state = gpu.state = fresh ? std::vector<float>(4, 0.0f) : std::vector<float>{0.0f, 2.0f, 0.0f, 0.0f};
        quantize(n.x, 40, 24, 24, fmt, true, true, dynamic, cpu, false);
        quantize(n.x, 40, 24, 24, fmt, true, true, dynamic, gpu, true);
        EXPECT_TRUE(bits_equal(cpu.scale_inv, gpu.scale_inv)) << cpu.scale_inv << " vs " << gpu.scale_inv;
        EXPECT_EQ(cpu.state, gpu.state);
        EXPECT_EQ(cpu.q, gpu.q);
        EXPECT_EQ(cpu.qt, gpu.qt);
      }
  const RowQuant cpu = quantize_rows(n.x, 40, 24, false), gpu = quantize_rows(n.x, 40, 24, true);
  EXPECT_EQ(cpu.q, gpu.q);
  EXPECT_EQ(cpu.qt, gpu.qt);
  EXPECT_EQ(cpu.si, gpu.si);
  EXPECT_EQ(cpu.si_t, gpu.si_t);
}

TEST(Fp8QuantizeCuda, PerRowBitwiseEqualToCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {37, 21}, {300, 136}, {1000, 640}, {0, 16}, {9, 0}}) {
    SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c);
    std::mt19937_64 rng(test_seed() + uint64_t(r * 31 + c));
    std::vector<bf16> x = random_vec<bf16>(size_t(r * c), rng, -20.0, 20.0);
    const RowQuant cpu = quantize_rows(x, r, c, false), gpu = quantize_rows(x, r, c, true);
    EXPECT_EQ(cpu.q, gpu.q);
    EXPECT_EQ(cpu.qt, gpu.qt);
    EXPECT_EQ(cpu.si, gpu.si);
    EXPECT_EQ(cpu.si_t, gpu.si_t);
  }
}

TEST(Fp8QuantizeCuda, ColumnSumsMatchCpuAndRepeat) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  for (bool per_row : {false, true})
    for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {70, 45}, {1000, 640}, {4100, 72}, {0, 16}}) {
      SCOPED_TRACE(testing::Message() << "r=" << r << " c=" << c << " per_row=" << per_row);
      std::mt19937_64 rng(test_seed() + uint64_t(r * 7 + c));
      std::vector<bf16> x = random_vec<bf16>(size_t(r * c), rng, -3.0, 3.0);
      const std::vector<float> cpu = col_sums_of(x, r, c, per_row, false), gpu = col_sums_of(x, r, c, per_row, true);
      ASSERT_EQ(gpu, col_sums_of(x, r, c, per_row, true)) << "not deterministic";
      for (int64_t k = 0; k < c; ++k) {
        double mag = 0;
        for (int64_t i = 0; i < r; ++i) mag += std::fabs(double(to_float(x[size_t(i * c + k)])));
        ASSERT_NEAR(gpu[size_t(k)], cpu[size_t(k)], 2e-6 * double(r + 1) * (mag + 1)) << "column " << k;
      }
    }
}

TEST(Fp8QuantizeCuda, TwoJobsInOneLaunchMatchTwoCalls) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(test_seed());
  const int64_t r0 = 300, c0 = 136, r1 = 48, c1 = 300;
  std::vector<bf16> x0 = random_vec<bf16>(size_t(r0 * c0), rng), x1 = random_vec<bf16>(size_t(r1 * c1), rng, -9, 9);
  Quant ref0, ref1;
  ref0.state = {1.0f, 0.0f, 0.0f};
  ref1.state = {5.0f, 0.0f, 0.0f};
  quantize(x0, r0, c0, c0, DType::kFloat8E4M3, true, true, true, ref0, false);
  quantize(x1, r1, c1, c1, DType::kFloat8E4M3, true, true, false, ref1, false);
  DeviceBuffer<bf16> d0(x0), d1(x1);
  const int64_t rp0 = fp8_padded(r0), cp0 = fp8_padded(c0), rp1 = fp8_padded(r1), cp1 = fp8_padded(c1);
  DeviceBuffer<uint8_t> q0(size_t(rp0 * cp0)), qt0(size_t(cp0 * rp0)), q1(size_t(rp1 * cp1)), qt1(size_t(cp1 * rp1));
  DeviceBuffer<float> s0(std::vector<float>{1.0f, 0.0f, 0.0f}), s1(std::vector<float>{5.0f, 0.0f, 0.0f}), si(2);
  for (auto* b : {&q0, &qt0, &q1, &qt1}) b->poison();
  Fp8QuantJob j[2];
  const DType e4 = DType::kFloat8E4M3;
  j[0].src = device_view(d0.ptr, DType::kBFloat16, {r0, c0});
  j[0].q = device_view(q0.ptr, e4, {rp0, cp0});
  j[0].qt = device_view(qt0.ptr, e4, {cp0, rp0});
  j[0].scale_inv = device_view(si.ptr, DType::kFloat32, {1});
  j[0].state = device_view(s0.ptr, DType::kFloat32, {3});
  j[0].dynamic = true;
  j[1].src = device_view(d1.ptr, DType::kBFloat16, {r1, c1});
  j[1].q = device_view(q1.ptr, e4, {rp1, cp1});
  j[1].qt = device_view(qt1.ptr, e4, {cp1, rp1});
  j[1].scale_inv = device_view(si.ptr + 1, DType::kFloat32, {1});
  j[1].state = device_view(s1.ptr, DType::kFloat32, {3});
  j[1].dynamic = false;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  fp8_quantize(j, 2, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaStreamDestroy(s);
  EXPECT_EQ(q0.download(), ref0.q);
  EXPECT_EQ(qt0.download(), ref0.qt);
  EXPECT_EQ(q1.download(), ref1.q);
  EXPECT_EQ(qt1.download(), ref1.qt);
  EXPECT_EQ(s0.download(), ref0.state);
  EXPECT_EQ(s1.download(), ref1.state);
  const auto sis = si.download();
  EXPECT_EQ(sis[0], ref0.scale_inv);
  EXPECT_EQ(sis[1], ref1.scale_inv);
}

TEST(Fp8GemmCuda, MatchesFloat64) {
  if (!has_gpu()) GTEST_SKIP() << "no GPU";
  for (const auto& g : gemm_cases()) run_gemm(g, true);
  run_gemm({1000, 1040, 2048, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kBFloat16, true, false}, true);
}
#endif

}  // namespace
