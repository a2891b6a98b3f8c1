// Rotary family: CPU core vs a float64 reference; CUDA core vs CPU core, bitwise in both numerics
// modes (skipped without a GPU); launch shapes and bad input on the host.
#include <cmath>
#include <functional>

#include "mmfuse/rope.h"
#include "test_util.h"

namespace mmfuse {
namespace {

using test::as_double;
using test::dtype_of;
using test::from_double;

enum class Src { kTable, kTableF32, kPositions, kFreqs };

struct Case {
  int B, L, Hq, Hk, D;
  RopeLayout layout;
  RopeNumerics numerics;
  Src src;
  bool backward;
  bool fused;  // q and k are head slices of one [B, L, Hq + 2*Hk, D] qkv buffer
  std::string name() const {
    const char* lay[] = {"plain", "sectioned", "interleaved"};
    const char* src_names[] = {"table", "table_f32", "positions", "freqs"};
    return detail::cat("B", B, "_L", L, "_Hq", Hq, "_Hk", Hk, "_D", D, "_", lay[int(layout)], "_",
                       numerics == RopeNumerics::kFp32 ? "fp32" : "hf_eager", "_", src_names[int(src)],
                       backward ? "_bwd" : "_fwd", fused ? "_fused" : "");
  }
};

RopeParams params_of(const Case& c) {
  RopeParams p;
  p.layout = c.layout;
  p.numerics = c.numerics;
  p.backward = c.backward;
  const int h = c.D / 2;
  if (c.layout == RopeLayout::kSectioned) {
    p.section[0] = h / 4, p.section[1] = (h - h / 4) / 2, p.section[2] = h - p.section[0] - p.section[1];
  } else if (c.layout == RopeLayout::kInterleaved) {
    p.section[1] = p.section[2] = h * 5 / 16, p.section[0] = h - 2 * p.section[1];
  }
  return p;
}

// Host data of one case: q/k storage (maybe fused), the angle source, and the fp32 angles per
// (axis, b, l, j) that a positions/freqs source implies.
template <class T>
struct Problem {
  Case c;
  RopeParams p;
  int A;
  int64_t heads_total;  // heads per token in the q/k storage
  std::vector<T> qk;    // [B, L, heads_total, D]
  std::vector<T> cos_t, sin_t;  // kTable: [A, B, L, D] in T
  std::vector<float> cos_f, sin_f;  // kTableF32
  std::vector<int64_t> pos;  // [A, B, L]
  std::vector<float> inv_freq;  // [h]
  std::vector<float> freqs;  // [B, L, h]
  std::vector<float> angles;  // [A, B, L, D]: the angle of every table entry (positions / freqs sources)

  explicit Problem(const Case& cs) : c(cs), p(params_of(cs)) {
    std::mt19937_64 rng(test::test_seed() ^ std::hash<std::string>{}(c.name()));
    A = c.layout == RopeLayout::kPlain ? 1 : 3;
    heads_total = c.fused ? c.Hq + 2 * c.Hk : c.Hq + c.Hk;
    const int64_t tok = int64_t(c.B) * c.L, h = c.D / 2;
    qk = test::random_vec<T>(size_t(tok * heads_total * c.D), rng);
    const size_t tab = size_t(A * tok * c.D);
    // Realistic multimodal positions: text runs share one value on all axes, vision tokens differ.
    std::uniform_int_distribution<int64_t> pd(0, 40000);
    std::bernoulli_distribution text(0.4);
    pos.resize(size_t(A * tok));
    for (int64_t t = 0; t < tok; ++t) {
      const int64_t base = pd(rng);
      const bool is_text = text(rng);
      for (int a = 0; a < A; ++a) pos[size_t(a * tok + t)] = is_text ? base : base + pd(rng) % 64;
    }
    inv_freq.resize(size_t(h));
    for (int64_t j = 0; j < h; ++j) inv_freq[size_t(j)] = float(std::pow(1000000.0, -2.0 * double(j) / c.D));
    std::uniform_real_distribution<double> fd(0.0, 200.0);
    freqs.resize(size_t(tok * h));
    for (auto& f : freqs) f = float(fd(rng));
    angles.resize(tab);
    for (int a = 0; a < A; ++a)
      for (int64_t t = 0; t < tok; ++t)
        for (int64_t i = 0; i < c.D; ++i) {
          const int64_t j = i % h;
          angles[size_t((a * tok + t) * c.D + i)] =
              c.src == Src::kFreqs ? freqs[size_t(t * h + j)] : float(pos[size_t(a * tok + t)]) * inv_freq[size_t(j)];
        }
    // Tables: cos/sin of the angles, perturbed so that channel j and j + h differ (the op must read
    // both halves), rounded to their storage type.
    std::uniform_real_distribution<double> jitter(-0.01, 0.01);
    cos_t.resize(tab), sin_t.resize(tab), cos_f.resize(tab), sin_f.resize(tab);
    for (size_t e = 0; e < tab; ++e) {
      const double cv = std::cos(double(angles[e])) + jitter(rng), sv = std::sin(double(angles[e])) + jitter(rng);
      cos_t[e] = from_double<T>(cv), sin_t[e] = from_double<T>(sv);
      cos_f[e] = float(cv), sin_f[e] = float(sv);
    }
  }

  int64_t tokens() const { return int64_t(c.B) * c.L; }
  std::vector<int64_t> qk_stride() const { return {c.L * heads_total * c.D, heads_total * c.D, c.D, 1}; }
  int64_t k_offset() const { return int64_t(c.Hq) * c.D; }

  // Views over given storage pointers (host or device).
  void views(void* qk_base, void* out_base, Device dev, TensorView& q, TensorView& k, TensorView& qo,
             TensorView& ko) const {
    const DType t = dtype_of<T>();
    auto mk = [&](void* base, int64_t off, int heads) {
      std::vector<int64_t> shape = {c.B, c.L, heads, c.D};
      TensorView v = make_view(static_cast<T*>(base) + off, t, dev, 4, shape.data(), qk_stride().data());
      return v;
    };
    q = mk(qk_base, 0, c.Hq);
    k = mk(qk_base, k_offset(), c.Hk);
    qo = mk(out_base, 0, c.Hq);
    ko = mk(out_base, k_offset(), c.Hk);
  }

  RopeAngles angle_views(void* cos_p, void* sin_p, void* pos_p, void* inv_p, void* freqs_p, Device dev,
                         bool table_f32) const {
    RopeAngles a;
    const std::vector<int64_t> tab = {A, c.B, c.L, c.D}, ps = {A, c.B, c.L}, fs = {c.B, c.L, c.D / 2},
                               is = {c.D / 2};
    if (c.src == Src::kTable || c.src == Src::kTableF32) {
      const DType t = table_f32 ? DType::kFloat32 : dtype_of<T>();
      a.cos = make_contiguous_view(cos_p, t, dev, 4, tab.data());
      a.sin = make_contiguous_view(sin_p, t, dev, 4, tab.data());
    } else if (c.src == Src::kPositions) {
      a.positions = make_contiguous_view(pos_p, DType::kInt64, dev, 3, ps.data());
      a.inv_freq = make_contiguous_view(inv_p, DType::kFloat32, dev, 1, is.data());
    } else {
      a.freqs = make_contiguous_view(freqs_p, DType::kFloat32, dev, 3, fs.data());
    }
    return a;
  }

  // Coefficient (c1, s1, c2, s2) of token t, half-channel j, in float64 from the case's source.
  void coef(int64_t t, int64_t j, double& c1, double& s1, double& c2, double& s2) const {
    const int64_t h = c.D / 2, tok = tokens();
    const int a = rope_axis(p, int(j));
    const size_t e1 = size_t((a * tok + t) * c.D + j), e2 = e1 + size_t(h);
    if (c.src == Src::kTable) {
      c1 = as_double(cos_t[e1]), s1 = as_double(sin_t[e1]), c2 = as_double(cos_t[e2]), s2 = as_double(sin_t[e2]);
    } else if (c.src == Src::kTableF32) {
      c1 = cos_f[e1], s1 = sin_f[e1], c2 = cos_f[e2], s2 = sin_f[e2];
    } else {
      c1 = c2 = std::cos(double(angles[e1]));
      s1 = s2 = std::sin(double(angles[e1]));
    }
  }
};

template <class T>
void run_cpu_vs_reference(const Case& c) {
  SCOPED_TRACE(c.name());
  Problem<T> pb(c);
  std::vector<T> out(pb.qk.size());
  test::poison(out);
  TensorView q, k, qo, ko;
  pb.views(pb.qk.data(), out.data(), Device{}, q, k, qo, ko);
  const RopeAngles a = pb.angle_views(c.src == Src::kTableF32 ? (void*)pb.cos_f.data() : (void*)pb.cos_t.data(),
                                      c.src == Src::kTableF32 ? (void*)pb.sin_f.data() : (void*)pb.sin_t.data(),
                                      pb.pos.data(), pb.inv_freq.data(), pb.freqs.data(), Device{},
                                      c.src == Src::kTableF32);
  mrope(q, k, a, pb.p, qo, ko, nullptr);

  // Tolerance from the format: each rounding of the mode costs one unit roundoff of the result
  // terms; cos/sin of an fp32 angle are within 2^-23 of the float64 values (per unit of |x|).
  const double u = test::unit_roundoff<T>();
  const double rel = c.numerics == RopeNumerics::kHfEager && !std::is_same_v<T, float> && !std::is_same_v<T, double>
                         ? 5 * u
                         : 2 * u;
  const double trig = (c.src == Src::kPositions || c.src == Src::kFreqs) && !std::is_same_v<T, double>
                          ? std::ldexp(1.0, -22)
                          : 0.0;
  const double tab_round = c.numerics == RopeNumerics::kHfEager && c.src == Src::kTableF32 ? u : 0.0;
  const int64_t h = c.D / 2;
  int64_t checked = 0;
  for (int64_t t = 0; t < pb.tokens(); ++t)
    for (int w = 0; w < 2; ++w)
      for (int hd = 0; hd < (w ? c.Hk : c.Hq); ++hd) {
        const size_t row = size_t((t * pb.heads_total + (w ? c.Hq : 0) + hd) * c.D);
        for (int64_t j = 0; j < h; ++j) {
          double c1, s1, c2, s2;
          pb.coef(t, j, c1, s1, c2, s2);
          const double x1 = as_double(pb.qk[row + j]), x2 = as_double(pb.qk[row + j + h]);
          double r1, r2, m1, m2;
          if (!c.backward) {
            r1 = x1 * c1 - x2 * s1, r2 = x2 * c2 + x1 * s2;
            m1 = std::fabs(x1 * c1) + std::fabs(x2 * s1), m2 = std::fabs(x2 * c2) + std::fabs(x1 * s2);
          } else {
            r1 = x1 * c1 + x2 * s2, r2 = x2 * c2 - x1 * s1;
            m1 = std::fabs(x1 * c1) + std::fabs(x2 * s2), m2 = std::fabs(x2 * c2) + std::fabs(x1 * s1);
          }
          const double y1 = as_double(out[row + j]), y2 = as_double(out[row + j + h]);
          const double extra = (trig + tab_round) * (std::fabs(x1) + std::fabs(x2)) + 1e-300;
          ASSERT_LE(std::fabs(y1 - r1), rel * m1 + extra) << "t=" << t << " w=" << w << " head=" << hd << " j=" << j;
          ASSERT_LE(std::fabs(y2 - r2), rel * m2 + extra) << "t=" << t << " w=" << w << " head=" << hd << " j=" << j;
          ++checked;
        }
      }
  EXPECT_EQ(checked, pb.tokens() * (c.Hq + c.Hk) * h);
  if (c.fused) {  // the v heads of the fused buffer must not be touched: still poison
    for (int64_t t = 0; t < pb.tokens(); ++t)
      for (int64_t e = (c.Hq + c.Hk) * c.D; e < pb.heads_total * c.D; ++e) {
        const T& v = out[size_t(t * pb.heads_total * c.D + e)];
        ASSERT_TRUE(std::isnan(as_double(v))) << "v head element overwritten";
      }
  }

  // In place gives bitwise the out-of-place result.
  std::vector<T> inplace = pb.qk;
  TensorView iq, ik, iqo, iko;
  pb.views(inplace.data(), inplace.data(), Device{}, iq, ik, iqo, iko);
  mrope(iq, ik, a, pb.p, iqo, iko, nullptr);
  for (int64_t t = 0; t < pb.tokens(); ++t)
    for (int64_t e = 0; e < (c.Hq + c.Hk) * c.D; ++e) {
      const size_t i = size_t(t * pb.heads_total * c.D + e);
      ASSERT_TRUE(test::bits_equal(inplace[i], out[i])) << "in place differs at " << i;
    }
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (int D : {64, 72, 80, 128, 256})
    for (auto lay : {RopeLayout::kPlain, RopeLayout::kSectioned, RopeLayout::kInterleaved})
      for (auto num : {RopeNumerics::kFp32, RopeNumerics::kHfEager})
        for (auto src : {Src::kTable, Src::kTableF32, Src::kPositions})
          for (bool bwd : {false, true}) cs.push_back({2, 13, 5, 3, D, lay, num, src, bwd, D == 128});
  cs.push_back({1, 67, 16, 16, 80, RopeLayout::kPlain, RopeNumerics::kFp32, Src::kFreqs, false, false});
  cs.push_back({1, 67, 16, 16, 80, RopeLayout::kPlain, RopeNumerics::kFp32, Src::kFreqs, true, false});
  cs.push_back({1, 50, 4, 0, 80, RopeLayout::kPlain, RopeNumerics::kFp32, Src::kFreqs, false, false});  // no k heads
  return cs;
}

TEST(RopeCpu, MatchesFloat64Reference) {
  for (const Case& c : cases()) {
    run_cpu_vs_reference<bf16>(c);
    run_cpu_vs_reference<f16>(c);
    run_cpu_vs_reference<float>(c);
    run_cpu_vs_reference<double>(c);
    if (HasFatalFailure()) return;
  }
}

TEST(RopeCpu, RealModelSize) {  // Qwen2.5-VL-7B heads, one 512-token row, fused qkv
  run_cpu_vs_reference<bf16>({1, 512, 28, 4, 128, RopeLayout::kSectioned, RopeNumerics::kFp32, Src::kPositions, false, true});
  run_cpu_vs_reference<bf16>({1, 512, 28, 4, 128, RopeLayout::kSectioned, RopeNumerics::kHfEager, Src::kTable, true, true});
}

TEST(RopeCpu, BackwardIsAdjoint) {  // <dy, R x> == <R^T dy, x> in float64
  for (auto lay : {RopeLayout::kPlain, RopeLayout::kSectioned, RopeLayout::kInterleaved}) {
    Case c{2, 9, 3, 2, 64, lay, RopeNumerics::kFp32, Src::kTableF32, false, false};
    Problem<double> pb(c);
    std::mt19937_64 rng(test::test_seed());
    std::vector<double> dy = test::random_vec<double>(pb.qk.size(), rng);
    std::vector<double> rx(pb.qk.size()), rtdy(pb.qk.size());
    TensorView q, k, qo, ko;
    const RopeAngles a = pb.angle_views(pb.cos_f.data(), pb.sin_f.data(), nullptr, nullptr, nullptr, Device{}, true);
    pb.views(pb.qk.data(), rx.data(), Device{}, q, k, qo, ko);
    mrope(q, k, a, pb.p, qo, ko, nullptr);
    RopeParams pt = pb.p;
    pt.backward = true;
    pb.views(dy.data(), rtdy.data(), Device{}, q, k, qo, ko);
    mrope(q, k, a, pt, qo, ko, nullptr);
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < dy.size(); ++i) lhs += dy[i] * rx[i], rhs += rtdy[i] * pb.qk[i];
    EXPECT_NEAR(lhs, rhs, 1e-9 * (std::fabs(lhs) + 1));
  }
}

TEST(RopeHost, AxisRule) {
  RopeParams p;
  p.layout = RopeLayout::kSectioned;
  p.section[0] = 16, p.section[1] = 24, p.section[2] = 24;
  EXPECT_EQ(rope_axis(p, 0), 0);
  EXPECT_EQ(rope_axis(p, 15), 0);
  EXPECT_EQ(rope_axis(p, 16), 1);
  EXPECT_EQ(rope_axis(p, 39), 1);
  EXPECT_EQ(rope_axis(p, 40), 2);
  EXPECT_EQ(rope_axis(p, 63), 2);
  p.layout = RopeLayout::kInterleaved;
  p.section[0] = 24, p.section[1] = 20, p.section[2] = 20;
  EXPECT_EQ(rope_axis(p, 0), 0);
  EXPECT_EQ(rope_axis(p, 1), 1);
  EXPECT_EQ(rope_axis(p, 2), 2);
  EXPECT_EQ(rope_axis(p, 58), 1);   // 58 % 3 == 1 and 58 < 60
  EXPECT_EQ(rope_axis(p, 59), 2);   // 59 % 3 == 2 and 59 < 60
  EXPECT_EQ(rope_axis(p, 60), 0);   // 60 % 3 == 0
  EXPECT_EQ(rope_axis(p, 61), 0);   // 61 % 3 == 1 but 61 >= 60
  EXPECT_EQ(rope_axis(p, 62), 0);   // 62 % 3 == 2 but 62 >= 60
}

TEST(RopeHost, LaunchShape) {
  RopeLaunch s = rope_launch_shape(16384, 32, 128, 2, 8);  // Qwen2.5-VL-7B, bf16, B4 L4096
  EXPECT_EQ(s.vec, 4);  // 8-byte slots
  EXPECT_EQ(s.chunks, 16);
  EXPECT_EQ(s.tokens_per_block, 16);
  EXPECT_EQ(s.threads, 256);
  EXPECT_EQ(s.blocks, 1024);
  EXPECT_EQ(s.rows_in_flight, kRopeMaxRowsInFlight);
  EXPECT_EQ(s.heads_per_group, kRopeMaxRowsInFlight);  // all of a thread's rows in flight at once
  EXPECT_EQ(s.head_groups, (32 + kRopeMaxRowsInFlight - 1) / kRopeMaxRowsInFlight);
  s = rope_launch_shape(16384, 32, 80, 2, 8);  // vision: 10 vectors a half head, 16 + 16 heads
  EXPECT_EQ(s.vec, 4);
  EXPECT_EQ(s.chunks, 10);
  EXPECT_EQ(s.threads, 320);  // 32 tokens: whole warps
  EXPECT_EQ(rope_launch_shape(100, 8, 128, 4, 8).vec, 2);  // fp32
  EXPECT_EQ(rope_launch_shape(100, 8, 128, 2, 2).vec, 2);  // 4-byte aligned strides only
  s = rope_launch_shape(100, 7, 72, 2, 8);  // 36 half-channels: 8-byte accesses; 7 heads
  EXPECT_EQ(s.vec, 4);
  EXPECT_EQ(s.chunks, 9);
  EXPECT_EQ(s.threads, 288);
  EXPECT_EQ(s.heads_per_group, std::min(7, kRopeMaxRowsInFlight));
  s = rope_launch_shape(100, 8, 128, 2, 1);  // misaligned strides: scalar accesses
  EXPECT_EQ(s.vec, 1);
  EXPECT_LE(s.threads, 512);
  s = rope_launch_shape(10, 20, 1024, 8, 1);  // largest head dim in fp64, scalar: 512 vectors a token
  EXPECT_EQ(s.threads, 512);
  EXPECT_EQ(s.rows_in_flight, 6);  // the staging slots stay within 48 KB
  EXPECT_LE(2 * s.rows_in_flight * s.threads * 8, 49152);
  EXPECT_GE(s.heads_per_group * s.head_groups, 20);  // the groups cover every head
  EXPECT_LT((s.head_groups - 1) * s.heads_per_group, 20);  // and none is empty
  EXPECT_EQ(rope_launch_shape(0, 4, 64, 2, 8).blocks, 0);
}

// ---- bad input --------------------------------------------------------------------------------

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(RopeBadInput, ErrorsNameTheProblem) {
  Case c{1, 4, 2, 2, 64, RopeLayout::kSectioned, RopeNumerics::kFp32, Src::kPositions, false, false};
  Problem<bf16> pb(c);
  std::vector<bf16> out(pb.qk.size());
  TensorView q, k, qo, ko;
  pb.views(pb.qk.data(), out.data(), Device{}, q, k, qo, ko);
  RopeAngles a = pb.angle_views(nullptr, nullptr, pb.pos.data(), pb.inv_freq.data(), nullptr, Device{}, false);
  EXPECT_NO_THROW(mrope(q, k, a, pb.p, qo, ko, nullptr));

  RopeParams bad = pb.p;
  bad.section[0] += 1;
  expect_error([&] { mrope(q, k, a, bad, qo, ko, nullptr); }, "mrope_section");
  RopeAngles a2 = a;
  a2.inv_freq.dtype = DType::kFloat16;
  expect_error([&] { mrope(q, k, a2, pb.p, qo, ko, nullptr); }, "inv_freq: expected dtype float32");
  a2 = a;
  a2.positions.dtype = DType::kFloat32;
  expect_error([&] { mrope(q, k, a2, pb.p, qo, ko, nullptr); }, "positions: expected dtype int32 or int64");
  TensorView k2 = k;
  k2.dtype = DType::kFloat16;
  expect_error([&] { mrope(q, k2, a, pb.p, qo, ko, nullptr); }, "k: expected dtype bfloat16");
  TensorView q2 = q, qo2 = qo;
  q2.shape[3] = 63, qo2.shape[3] = 63;
  expect_error([&] { mrope(q2, k, a, pb.p, qo2, ko, nullptr); }, "even head dim");
  q2 = q;
  q2.device = Device{DeviceType::kCUDA, 0};
  expect_error([&] { mrope(q2, k, a, pb.p, qo, ko, nullptr); }, "expected device");
  q2 = q;
  q2.stride[3] = 2;
  expect_error([&] { mrope(q2, k, a, pb.p, qo, ko, nullptr); }, "last dim must be contiguous");
  q2 = q;
  q2.dtype = DType::kInt32;
  expect_error([&] { mrope(q2, k, a, pb.p, qo, ko, nullptr); }, "q: expected dtype");
  TensorView shifted = q;  // output overlapping the input by one element
  shifted.data = static_cast<bf16*>(q.data) + 1;
  expect_error([&] { mrope(q, k, a, pb.p, shifted, ko, nullptr); }, "partially overlaps");
  RopeAngles none;
  expect_error([&] { mrope(q, k, none, pb.p, qo, ko, nullptr); }, "exactly one angle source");
  RopeAngles both = a;
  both.freqs = a.inv_freq;
  expect_error([&] { mrope(q, k, both, pb.p, qo, ko, nullptr); }, "exactly one angle source");
  a2 = a;
  a2.positions.shape[2] = 3;
  expect_error([&] { mrope(q, k, a2, pb.p, qo, ko, nullptr); }, "positions: expected 4 tokens");
  a2 = a;
  a2.inv_freq.shape[0] = 31;
  expect_error([&] { mrope(q, k, a2, pb.p, qo, ko, nullptr); }, "inv_freq: expected shape [32]");
}

// ---- CUDA vs CPU, bitwise ----------------------------------------------------------------------
#ifdef MMFUSE_WITH_CUDA

template <class T>
void run_cuda_vs_cpu(const Case& c) {
  SCOPED_TRACE(c.name());
  Problem<T> pb(c);
  const bool table_f32 = c.src != Src::kTable;
  // For positions / freqs the CPU reference reads fp32 tables made by sincosf on the device from
  // the very angles the kernel computes: bitwise comparison of everything but the libm.
  std::vector<float> cos_f = pb.cos_f, sin_f = pb.sin_f;
  if (c.src == Src::kPositions || c.src == Src::kFreqs) {
    test::DeviceBuffer<float> ang(pb.angles), dc(pb.angles.size()), ds(pb.angles.size());
    test::device_sincosf(ang.ptr, dc.ptr, ds.ptr, int64_t(pb.angles.size()));
    cos_f = dc.download(), sin_f = ds.download();
  }
  std::vector<T> ref(pb.qk.size());
  test::poison(ref);
  TensorView q, k, qo, ko;
  pb.views(pb.qk.data(), ref.data(), Device{}, q, k, qo, ko);
  Case cc = c;
  cc.src = c.src == Src::kTable ? Src::kTable : Src::kTableF32;
  Problem<T> host_pb = pb;
  host_pb.c = cc;
  RopeAngles ha = host_pb.angle_views(table_f32 ? (void*)cos_f.data() : (void*)pb.cos_t.data(),
                                      table_f32 ? (void*)sin_f.data() : (void*)pb.sin_t.data(), nullptr, nullptr,
                                      nullptr, Device{}, table_f32);
  mrope(q, k, ha, pb.p, qo, ko, nullptr);

  test::DeviceBuffer<T> dqk(pb.qk), dout(pb.qk.size());
  dout.upload(ref);  // v heads of a fused buffer keep the reference's poison
  // poison q/k rows of the device output
  {
    std::vector<T> poisoned = ref;
    for (int64_t t = 0; t < pb.tokens(); ++t)
      for (int64_t e = 0; e < (c.Hq + c.Hk) * c.D; ++e)
        std::memset(static_cast<void*>(&poisoned[size_t(t * pb.heads_total * c.D + e)]), 0xFF, sizeof(T));
    dout.upload(poisoned);
  }
  test::DeviceBuffer<T> dcos(pb.cos_t), dsin(pb.sin_t);
  test::DeviceBuffer<float> dcosf(pb.cos_f), dsinf(pb.sin_f), dinv(pb.inv_freq), dfreqs(pb.freqs);
  test::DeviceBuffer<int64_t> dpos(pb.pos);
  const Device dev{DeviceType::kCUDA, 0};
  pb.views(dqk.ptr, dout.ptr, dev, q, k, qo, ko);
  RopeAngles da = pb.angle_views(c.src == Src::kTableF32 ? (void*)dcosf.ptr : (void*)dcos.ptr,
                                 c.src == Src::kTableF32 ? (void*)dsinf.ptr : (void*)dsin.ptr, dpos.ptr, dinv.ptr,
                                 dfreqs.ptr, dev, c.src == Src::kTableF32);
  cudaStream_t stream;
  MMFUSE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  mrope(q, k, da, pb.p, qo, ko, stream);
  MMFUSE_TEST_CUDA(cudaStreamSynchronize(stream));
  MMFUSE_TEST_CUDA(cudaStreamDestroy(stream));
  const std::vector<T> got = dout.download();
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_TRUE(test::bits_equal(got[i], ref[i]) || (std::isnan(as_double(got[i])) && std::isnan(as_double(ref[i]))))
        << "index " << i << ": cuda " << as_double(got[i]) << " cpu " << as_double(ref[i]);

  // In place (outputs are the inputs) gives bitwise the same q/k rows and leaves the rest alone.
  pb.views(dqk.ptr, dqk.ptr, dev, q, k, qo, ko);
  mrope(q, k, da, pb.p, qo, ko, nullptr);
  const std::vector<T> in_place = dqk.download();
  for (int64_t t = 0; t < pb.tokens(); ++t)
    for (int64_t e = 0; e < pb.heads_total * c.D; ++e) {
      const size_t i = size_t(t * pb.heads_total * c.D + e);
      const T& want = e < (c.Hq + c.Hk) * c.D ? got[i] : pb.qk[i];
      ASSERT_TRUE(test::bits_equal(in_place[i], want)) << "in place differs at " << i;
    }
}

TEST(RopeCuda, BitwiseEqualToCpu) {
  if (!test::has_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<Case> cs = cases();
  cs.push_back({3, 1000, 28, 4, 128, RopeLayout::kSectioned, RopeNumerics::kFp32, Src::kPositions, false, true});
  cs.push_back({3, 1000, 28, 4, 128, RopeLayout::kSectioned, RopeNumerics::kHfEager, Src::kTable, true, false});
  // Per-token angles: the token-tile path (sm_90+) at the vision head dim and others (templated and
  // runtime vector counts, D = 72 only in fp32), fused qkv, batches whose tiles straddle rows, k
  // absent, many tiles per block; the generic kernel for what it cannot take (hf_eager, odd D).
  const auto plain = RopeLayout::kPlain;
  const auto fp32 = RopeNumerics::kFp32;
  for (bool bwd : {false, true}) {
    cs.push_back({1, 4099, 16, 16, 80, plain, fp32, Src::kFreqs, bwd, false});
    cs.push_back({1, 333, 16, 16, 80, plain, fp32, Src::kFreqs, bwd, true});
    cs.push_back({3, 77, 5, 3, 64, plain, fp32, Src::kFreqs, bwd, false});
    cs.push_back({2, 45, 3, 2, 128, plain, fp32, Src::kFreqs, bwd, true});
    cs.push_back({1, 129, 4, 4, 96, plain, fp32, Src::kFreqs, bwd, false});
    cs.push_back({1, 101, 4, 2, 72, plain, fp32, Src::kFreqs, bwd, false});
    cs.push_back({1, 50, 4, 0, 80, plain, fp32, Src::kFreqs, bwd, false});
    cs.push_back({1, 40001, 2, 1, 16, plain, fp32, Src::kFreqs, bwd, false});
    cs.push_back({2, 63, 4, 4, 80, plain, RopeNumerics::kHfEager, Src::kFreqs, bwd, false});
  }
  for (const Case& c : cs) {
    run_cuda_vs_cpu<bf16>(c);
    run_cuda_vs_cpu<f16>(c);
    run_cuda_vs_cpu<float>(c);
    if (c.src == Src::kTable || c.src == Src::kTableF32) run_cuda_vs_cpu<double>(c);
    if (HasFatalFailure()) return;
  }
}

TEST(RopeCuda, InPlaceOnFusedQkv) {
  if (!test::has_gpu()) GTEST_SKIP() << "no CUDA device";
  Case c{2, 333, 28, 4, 128, RopeLayout::kSectioned, RopeNumerics::kHfEager, Src::kPositions, false, true};
  Problem<bf16> pb(c);
  test::DeviceBuffer<bf16> a(pb.qk), b(pb.qk.size());
  b.poison();
  test::DeviceBuffer<float> dinv(pb.inv_freq);
  test::DeviceBuffer<int64_t> dpos(pb.pos);
  const Device dev{DeviceType::kCUDA, 0};
  TensorView q, k, qo, ko;
  RopeAngles da = pb.angle_views(nullptr, nullptr, dpos.ptr, dinv.ptr, nullptr, dev, false);
  pb.views(a.ptr, b.ptr, dev, q, k, qo, ko);
  mrope(q, k, da, pb.p, qo, ko, nullptr);
  pb.views(a.ptr, a.ptr, dev, q, k, qo, ko);
  mrope(q, k, da, pb.p, qo, ko, nullptr);
  MMFUSE_TEST_CUDA(cudaDeviceSynchronize());
  const auto x = a.download(), y = b.download();
  for (int64_t t = 0; t < pb.tokens(); ++t)
    for (int64_t e = 0; e < (c.Hq + c.Hk) * c.D; ++e) {
      const size_t i = size_t(t * pb.heads_total * c.D + e);
      ASSERT_TRUE(test::bits_equal(x[i], y[i])) << i;
    }
}
#endif

}  // namespace
}  // namespace mmfuse
