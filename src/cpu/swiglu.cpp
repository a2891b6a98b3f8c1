// CPU backend of SwiGLU: rows in parallel, the formulas of include/mmfuse/swiglu.h.
#include <cmath>

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

void swiglu_backward_cpu(const TensorView& dy, const TensorView& gate_up, TensorView& d_gate_up, TensorView& y) {
  const int64_t T = gate_up.shape[0], I = gate_up.shape[1] / 2;
  dispatch_floating(gate_up.dtype, "swiglu_backward: gate_up", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = typename compute_type<S>::type;
    parallel_for(T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const S* gu = static_cast<const S*>(gate_up.data) + t * gate_up.stride[0];
        const S* d = static_cast<const S*>(dy.data) + t * dy.stride[0];
        S* dgu = static_cast<S*>(d_gate_up.data) + t * d_gate_up.stride[0];
        S* yr = y.defined() ? static_cast<S*>(y.data) + t * y.stride[0] : nullptr;
        for (int64_t j = 0; j < I; ++j) {
          const C g = load_val(gu[j]), u = load_val(gu[I + j]), dv = load_val(d[j]);
          const C sig = C(1) / (C(1) + std::exp(-g)), s = g * sig;
          dgu[j] = store_val<S>(dv * u * (sig * (C(1) + g * (C(1) - sig))));
          dgu[I + j] = store_val<S>(dv * s);
          if (yr) yr[j] = store_val<S>(s * u);
        }
      }
    });
  });
}

}  // namespace detail
}  // namespace mmfuse
