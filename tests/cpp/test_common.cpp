// Host-only tests of the shared pieces: dtype conversions (exhaustive), views, errors.
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/overlap.h"
#include "common/parallel.h"
#include "common/overrides.h"
#include "test_util.h"

namespace mmfuse {
namespace {

// Round-to-nearest-even of a double to a format with `mant` explicit mantissa bits, min normal
// exponent `emin` and max finite `maxv`: the reference for the conversion helpers.
double round_ref(double x, int mant, int emin, double maxv) {
  if (x == 0) return x;
  const double a = std::fabs(x);
  int e = std::ilogb(a);
  if (e < emin) e = emin;
  const double ulp = std::ldexp(1.0, e - mant);
  double r = std::nearbyint(a / ulp) * ulp;  // default rounding mode: nearest-even
  const double halfway = maxv + std::ldexp(1.0, std::ilogb(maxv) - mant - 1);
  if (a >= halfway) r = INFINITY;
  return std::copysign(r, x);
}

TEST(Numerics, Bf16RoundTripExhaustive) {
  for (uint32_t b = 0; b < 65536; ++b) {
    bf16 v{uint16_t(b)};
    float f = to_float(v);
    if (std::isnan(f)) continue;
    EXPECT_EQ(to_bf16(f).bits, v.bits) << b;
  }
}

TEST(Numerics, F16RoundTripExhaustive) {
  for (uint32_t b = 0; b < 65536; ++b) {
    f16 v{uint16_t(b)};
    float f = to_float(v);
    if (std::isnan(f)) continue;
    EXPECT_EQ(to_f16(f).bits, v.bits) << b;
  }
}

TEST(Numerics, RoundingMatchesReference) {
  std::mt19937_64 rng(test::test_seed());
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    float f = bits_float(bits(rng));
    if (!std::isfinite(f)) continue;
    // Ties matter most: also test the exact midpoint between neighbours.
    const double bref = round_ref(f, 7, -126, 3.3895313892515355e38);
    EXPECT_EQ(double(to_float(to_bf16(f))), bref) << f;
    const double href = round_ref(f, 10, -14, 65504.0);
    ASSERT_EQ(double(to_float(to_f16(f))), href) << f;
  }
  EXPECT_EQ(to_f16(65519.99f).bits, 0x7bffu);
  EXPECT_EQ(to_f16(65520.0f).bits, 0x7c00u);
  EXPECT_EQ(to_bf16(1.0f + 1.0f / 256).bits, to_bf16(1.0f).bits);  // tie -> even
}

TEST(Error, MessageNamesArgumentAndLocation) {
  try {
    MMFUSE_CHECK(1 == 2, "x: expected 1, got ", 2);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "x: expected 1, got 2");
    EXPECT_NE(std::string(e.what()).find("test_common.cpp:"), std::string::npos);
  }
}

TEST(PathOverride, SetByNameAndErrorsNamingTheChoices) {
  EXPECT_EQ(path_override(Knob::kMoeBackward), 0);  // auto unless the environment says otherwise
  {
    test::ScopedOverride force("MMFUSE_MOE_BWD", "entry");
    EXPECT_EQ(path_override(Knob::kMoeBackward), 4);
    EXPECT_EQ(path_override(Knob::kMoePlan), 0);
  }
  EXPECT_EQ(path_override(Knob::kMoeBackward), 0);
  set_path_override("MMFUSE_MOE_PLAN_HIST", "");  // empty: auto
  EXPECT_EQ(path_override(Knob::kMoePlanHist), 0);
  test::expect_error([] { set_path_override("MMFUSE_MOE_PLAN", "grid"); },
                     "moe_plan: MMFUSE_MOE_PLAN: expected auto, cooperative or two, got 'grid'");
  test::expect_error([] { set_path_override("MMFUSE_MOE_BWD", "warps"); },
                     "moe_unpermute_backward: MMFUSE_MOE_BWD: expected auto, tile, general, warp or entry, got 'warps'");
  test::expect_error([] { set_path_override("MMFUSE_MOE_PATH", "auto"); },
                     "set_path_override: name: expected one of MMFUSE_MOE_PLAN, MMFUSE_MOE_PLAN_HIST, MMFUSE_MOE_BWD, "
                     "MMFUSE_RMS_NORM_BWD, MMFUSE_LCE_GRAD, got 'MMFUSE_MOE_PATH'");
  EXPECT_EQ(path_override(Knob::kMoePlan), 0);  // a refused value leaves the knob as it was
}

// Overlap of strided views: exact for head slices of one fused buffer, rows with gaps, dense views.
TEST(Overlap, ViewsShareAnElementOrNot) {
  static uint16_t buf[1 << 16];
  auto v = [&](int64_t off, std::vector<int64_t> sh, std::vector<int64_t> st) {
    return make_view(buf + off, DType::kBFloat16, Device{}, int(sh.size()), sh.data(), st.data());
  };
  const int64_t C = 20 * 8;  // qkv [B=2, L=5, 16 + 2 + 2 heads, D=8]
  const TensorView q = v(0, {2, 5, 16, 8}, {5 * C, C, 8, 1}), k = v(16 * 8, {2, 5, 2, 8}, {5 * C, C, 8, 1});
  const TensorView val = v(18 * 8, {2, 5, 2, 8}, {5 * C, C, 8, 1});
  EXPECT_FALSE(views_overlap(q, k));
  EXPECT_FALSE(views_overlap(k, q));
  EXPECT_FALSE(views_overlap(k, val));
  EXPECT_TRUE(views_overlap(q, q));
  EXPECT_TRUE(views_overlap(v(15 * 8, {2, 5, 2, 8}, {5 * C, C, 8, 1}), q));  // shares head 15
  // rows of 5 elements, 10 apart: 8 elements on, b(0, 2) is a(1, 0); 5 on, the other halves of the rows
  const TensorView a = v(0, {3, 5}, {10, 1});
  EXPECT_TRUE(views_overlap(a, v(8, {3, 5}, {10, 1})));
  EXPECT_FALSE(views_overlap(a, v(5, {3, 5}, {10, 1})));
  EXPECT_TRUE(views_overlap(v(0, {4, 6}, {6, 1}), v(0, {6, 4}, {1, 6})));  // a dense buffer and its transpose
  EXPECT_FALSE(views_overlap(v(0, {4, 6}, {6, 1}), v(24, {4, 6}, {6, 1})));
  EXPECT_FALSE(views_overlap(v(0, {0, 6}, {6, 1}), v(0, {4, 6}, {6, 1})));  // no elements
  EXPECT_TRUE(expanded(v(0, {4, 6}, {0, 1})));
  EXPECT_FALSE(expanded(v(0, {1, 6}, {0, 1})));
  test::expect_error([&] { check_not_expanded("op", v(0, {4, 6}, {0, 1}), "out"); },
                     "op: out is expanded (a stride of 0 along a dim of more than one element): every output element "
                     "must have memory of its own, got strides [0, 1]");
}

}  // namespace
}  // namespace mmfuse

// parallel_for: every index once; an exception from any range (a worker thread's too) reaches the
// caller after all ranges have finished, the lowest range's.
TEST(ParallelFor, CoversEveryIndexAndRethrowsTheLowestRangesError) {
  std::vector<std::atomic<int>> seen(1000);
  mmfuse::parallel_for(1000, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) seen[size_t(i)]++;
  });
  for (const auto& v : seen) ASSERT_EQ(v.load(), 1);
  std::atomic<int64_t> done{0};
  auto throws_from = [&](int64_t first) {
    try {
      mmfuse::parallel_for(1000, 1, [&](int64_t b, int64_t e) {
        done += e - b;
        if (e > first) throw std::runtime_error("range from " + std::to_string(std::max(b, first)));
      });
    } catch (const std::runtime_error& err) {
      return std::string(err.what());
    }
    return std::string("no error");
  };
  done = 0;
  EXPECT_EQ(throws_from(0), "range from 0");  // every range throws: the first one's error
  EXPECT_EQ(done.load(), 1000);               // and every range ran to its end first
  EXPECT_EQ(throws_from(999), "range from 999");  // only the last range (a worker's where threads > 1)
  EXPECT_EQ(throws_from(1000), "no error");
}
