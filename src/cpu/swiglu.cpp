// CPU backend of SwiGLU: rows in parallel, the formulas of include/mmfuse/swiglu.h.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backends/swiglu.h"
#include "common/dispatch.h"
#include "common/parallel.h"

namespace mmfuse {
namespace detail {

void swiglu_cpu(const TensorView& gate_up, TensorView& out) {
  const int64_t T = gate_up.shape[0], I = gate_up.shape[1] / 2;
  dispatch_floating(gate_up.dtype, "swiglu: gate_up", [&](auto tag) {
    using S = typename decltype(tag)::type;
    parallel_for(T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const S* gu = static_cast<const S*>(gate_up.data) + t * gate_up.stride[0];
        S* y = static_cast<S*>(out.data) + t * out.stride[0];
        for (int64_t j = 0; j < I; ++j) y[j] = swiglu_value_cpu<S>(gu[j], gu[I + j]);
      }
    });
  });
}

namespace {

// The backward over rows, gate and up read through load(t, j) (column j of row t, in C).
template <class S, class Load>
void backward_rows(const TensorView& dy, TensorView& d_gate_up, TensorView& y, int64_t T, int64_t I, Load load) {
  using C = typename compute_type<S>::type;
  parallel_for(T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const S* d = static_cast<const S*>(dy.data) + t * dy.stride[0];
      S* dgu = static_cast<S*>(d_gate_up.data) + t * d_gate_up.stride[0];
      S* yr = y.defined() ? static_cast<S*>(y.data) + t * y.stride[0] : nullptr;
      for (int64_t j = 0; j < I; ++j) {
        C dg, du, yv;
        swiglu_grad_value_cpu<C>(load(t, j), load(t, I + j), load_val(d[j]), dg, du, yv);
        dgu[j] = store_val<S>(dg);
        dgu[I + j] = store_val<S>(du);
        if (yr) yr[j] = store_val<S>(yv);
      }
    }
  });
}

}  // namespace

void swiglu_backward_cpu(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y) {
  const int64_t T = gate_up.shape[0], I = gate_up.shape[1] / 2;
  dispatch_floating(gate_up.dtype, "swiglu_backward: gate_up", [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* gu = static_cast<const S*>(gate_up.data);
    const int64_t ld = gate_up.stride[0];
    backward_rows<S>(dy, d_gate_up, y, T, I, [&](int64_t t, int64_t j) { return load_val(gu[t * ld + j]); });
  });
}

void swiglu_pack_fp8_cpu(const TensorView& gate_up, TensorView& q, TensorView& scale_inv) {
  const int64_t T = gate_up.shape[0], C2 = gate_up.shape[1], tiles = scale_inv.shape[1];
  dispatch_floating(gate_up.dtype, "swiglu_pack_fp8: gate_up", [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<S, double>) {
      parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const S* x = static_cast<const S*>(gate_up.data) + t * gate_up.stride[0];
          uint8_t* qr = static_cast<uint8_t*>(q.data) + t * q.stride[0];
          float* si = static_cast<float*>(scale_inv.data) + t * scale_inv.stride[0];
          for (int64_t c = 0; c < tiles; ++c) {
            const int64_t j0 = c * kSwigluPackTile, j1 = std::min(C2, j0 + kSwigluPackTile);
            float amax = 0.0f;
            for (int64_t j = j0; j < j1; ++j) amax = std::max(amax, fp8_finite_abs(to_float(x[j])));
            const int k = swiglu_pack_exponent(float_bits(amax));
            const float scale = std::ldexp(1.0f, k);
            for (int64_t j = j0; j < j1; ++j) qr[j] = float_to_fp8(fp8_scaled(to_float(x[j]), scale), true);
            si[c] = std::ldexp(1.0f, -k);
          }
        }
      });
    }
  });
}

void swiglu_backward_fp8_cpu(const TensorView& dy, const TensorView& q, const TensorView& scale_inv,
                             TensorView& d_gate_up, TensorView& y) {
  const int64_t T = q.shape[0], I = q.shape[1] / 2;
  const uint8_t* qd = static_cast<const uint8_t*>(q.data);
  const float* sd = static_cast<const float*>(scale_inv.data);
  const int64_t lq = q.stride[0], ls = scale_inv.stride[0];
  auto load = [&](int64_t t, int64_t j) { return swiglu_unpack_cpu(qd[t * lq + j], sd[t * ls + j / kSwigluPackTile]); };
  dispatch_floating(dy.dtype, "swiglu_backward_fp8: dy", [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<S, double>) backward_rows<S>(dy, d_gate_up, y, T, I, load);
  });
}

}  // namespace detail
}  // namespace mmfuse
