// CPU backend of the rotary family: the reference for the CUDA kernels and the path CPU users run.
// Compiled with -ffp-contract=off: every multiply and add is rounded on its own, as on the GPU.
#include <cmath>
#include <vector>

#include "common/dispatch.h"
#include "common/parallel.h"
#include "backends/rope.h"
#include "mmfuse/rope.h"

namespace mmfuse {
namespace detail {
namespace {

template <class IT>
float position_at(const TensorView& pos, int axis, int64_t b, int64_t l) {
  const IT* p = pos.ptr<IT>();
  return float(p[axis * pos.stride[0] + b * pos.stride[1] + l * pos.stride[2]]);
}

template <class TT>
double table_at(const TensorView& t, int axis, int64_t b, int64_t l, int64_t i) {
  const TT* p = t.ptr<TT>();
  return double(load_val(p[axis * t.stride[0] + b * t.stride[1] + l * t.stride[2] + i * t.stride[3]]));
}

double table_value(const TensorView& t, int axis, int64_t b, int64_t l, int64_t i) {
  return t.dtype == DType::kFloat32 ? table_at<float>(t, axis, b, l, i) : dispatch_floating(t.dtype, "table", [&](auto tag) {
    using TT = typename decltype(tag)::type;
    return table_at<TT>(t, axis, b, l, i);
  });
}

// Per-token coefficients: out1 = x1*P1 - x2*Q1, out2 = x2*P2 + x1*Q2 for each half-channel.
template <class C>
struct Coef {
  std::vector<C> p1, q1, p2, q2;
  explicit Coef(int64_t h) : p1(h), q1(h), p2(h), q2(h) {}
};

template <class T>
void token_coefficients(const RopeAngles& a, const RopeParams& p, int64_t b, int64_t l, int64_t h,
                        Coef<typename compute_type<T>::type>& k) {
  using C = typename compute_type<T>::type;
  const bool eager = p.numerics == RopeNumerics::kHfEager;
  auto finish = [&](C v) { return eager ? round_to<T>(v) : v; };
  for (int64_t j = 0; j < h; ++j) {
    const int axis = rope_axis(p, int(j));
    C c1, s1, c2, s2;
    if (a.cos.defined()) {
      c1 = finish(C(table_value(a.cos, axis, b, l, j)));
      s1 = finish(C(table_value(a.sin, axis, b, l, j)));
      c2 = finish(C(table_value(a.cos, axis, b, l, j + h)));
      s2 = finish(C(table_value(a.sin, axis, b, l, j + h)));
    } else {
      float angle;
      if (a.positions.defined()) {
        const float pos = a.positions.dtype == DType::kInt32 ? position_at<int32_t>(a.positions, axis, b, l)
                                                             : position_at<int64_t>(a.positions, axis, b, l);
        angle = pos * a.inv_freq.ptr<float>()[j * a.inv_freq.stride[0]];
      } else {
        angle = a.freqs.ptr<float>()[b * a.freqs.stride[0] + l * a.freqs.stride[1] + j * a.freqs.stride[2]];
      }
      // Host libm in double, rounded once: within an ulp of the GPU's sincosf (not bit-equal to it).
      c1 = c2 = finish(C(std::cos(double(angle))));
      s1 = s2 = finish(C(std::sin(double(angle))));
    }
    if (!p.backward) {
      k.p1[j] = c1, k.q1[j] = s1, k.p2[j] = c2, k.q2[j] = s2;
    } else {  // adjoint: dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1
      k.p1[j] = c1, k.q1[j] = -s2, k.p2[j] = c2, k.q2[j] = -s1;
    }
  }
}

template <class T>
void rotate_rows(const TensorView& x, TensorView& out, int64_t b, int64_t l, int64_t h, bool eager,
                 const Coef<typename compute_type<T>::type>& k) {
  using C = typename compute_type<T>::type;
  const int64_t H = x.shape[2];
  const T* xp = x.ptr<T>();
  T* op = out.ptr<T>();
  for (int64_t hh = 0; hh < H; ++hh) {
    const T* xr = xp + b * x.stride[0] + l * x.stride[1] + hh * x.stride[2];
    T* orow = op + b * out.stride[0] + l * out.stride[1] + hh * out.stride[2];
    for (int64_t j = 0; j < h; ++j) {
      const C x1 = load_val(xr[j]), x2 = load_val(xr[j + h]);
      C y1, y2;
      if (eager) {
        y1 = round_to<T>(round_to<T>(x1 * k.p1[j]) - round_to<T>(x2 * k.q1[j]));
        y2 = round_to<T>(round_to<T>(x2 * k.p2[j]) + round_to<T>(x1 * k.q2[j]));
      } else {
        const C a1 = x1 * k.p1[j], b1 = x2 * k.q1[j];
        const C a2 = x2 * k.p2[j], b2 = x1 * k.q2[j];
        y1 = a1 - b1;
        y2 = a2 + b2;
      }
      orow[j] = store_val<T>(y1);  // in place is safe: both halves were read above
      orow[j + h] = store_val<T>(y2);
    }
  }
}

}  // namespace

void mrope_cpu(const TensorView& q, const TensorView& k, const RopeAngles& a, const RopeParams& p,
               TensorView& q_out, TensorView& k_out) {
  const int64_t B = q.shape[0], L = q.shape[1], h = q.shape[3] / 2;
  const bool eager = p.numerics == RopeNumerics::kHfEager;
  dispatch_floating(q.dtype, "q", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = typename compute_type<T>::type;
    const int64_t work_per_token = (q.shape[2] + k.shape[2] + 4) * 2 * h;
    parallel_for(B * L, std::max<int64_t>(1, 65536 / work_per_token), [&](int64_t t0, int64_t t1) {
      Coef<C> coef(h);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / L, l = t % L;
        token_coefficients<T>(a, p, b, l, h, coef);
        rotate_rows<T>(q, q_out, b, l, h, eager, coef);
        if (k.shape[2] > 0) rotate_rows<T>(k, k_out, b, l, h, eager, coef);
      }
    });
  });
}

}  // namespace detail
}  // namespace mmfuse
