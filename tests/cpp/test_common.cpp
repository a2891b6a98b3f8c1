// Host-only tests of the shared pieces: dtype conversions (exhaustive), views, errors.
#include <cmath>

#include "common/env.h"
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

TEST(EnvChoice, IndexOfTheValueAndAnErrorNamingTheChoices) {
  const char* name = "MMFUSE_TEST_ENV_CHOICE";
  unsetenv(name);
  EXPECT_EQ(env_choice("op", name, {"auto", "a", "b"}), 0);  // unset: the first
  {
    test::ScopedEnv env(name, "");
    EXPECT_EQ(env_choice("op", name, {"auto", "a", "b"}), 0);
  }
  {
    test::ScopedEnv env(name, "b");
    EXPECT_EQ(env_choice("op", name, {"auto", "a", "b"}), 2);
  }
  {
    test::ScopedEnv env(name, "c");
    test::expect_error([&] { env_choice("op", name, {"auto", "a", "b"}); },
                       "op: MMFUSE_TEST_ENV_CHOICE: expected auto, a or b, got 'c'");
    test::expect_error([&] { env_choice("op", name, {"auto", "registers"}); },
                       "op: MMFUSE_TEST_ENV_CHOICE: expected auto or registers, got 'c'");
  }
}

}  // namespace
}  // namespace mmfuse
