// CPU backend of linear_cross_entropy's logits gradient: rows in parallel, the formulas of
// include/mmfuse/linear_cross_entropy.h (the row's sums in double).
#include <cmath>
#include <limits>

#include "backends/linear_cross_entropy.h"
#include "common/dispatch.h"
#include "common/parallel.h"

namespace mmfuse {
namespace detail {

void linear_cross_entropy_logits_grad_cpu(const TensorView& z, const TensorView& labels, const TensorView& row_scale,
                                          const LceParams& p, TensorView& loss, TensorView& g) {
  const int64_t C = z.shape[0], V = z.shape[1];
  const float eps = p.label_smoothing, cap = p.softcap;
  auto soft = [&](float v) { return cap > 0.0f ? cap * std::tanh(v / cap) : v; };
  auto rows = [&](auto* zin, auto* gout) {
    using S = std::remove_pointer_t<decltype(gout)>;
    using Z = std::remove_const_t<std::remove_pointer_t<decltype(zin)>>;
    parallel_for(C, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const Z* zz = zin + r * z.stride[0];
        auto zr = [&](int64_t j) { return float(load_val(zz[j])); };
        S* gr = gout ? gout + r * g.stride[0] : nullptr;
        const int64_t y = static_cast<const int64_t*>(labels.data)[r];
        float& lr = static_cast<float*>(loss.data)[r];
        if (y == p.ignore_index) {
          lr = 0.0f;
          if (gr)
            for (int64_t j = 0; j < V; ++j) gr[j] = store_val<S>(0.0f);
          continue;
        }
        MMFUSE_CHECK(y >= 0 && y < V, "linear_cross_entropy_logits_grad: labels[", r, "] = ", y,
                     ": expected a class in [0, ", V, ") or ignore_index ", p.ignore_index);
        float m = -std::numeric_limits<float>::infinity();
        bool nan = false;
        for (int64_t j = 0; j < V; ++j) {
          const float v = soft(zr(j));
          nan = nan || std::isnan(v);
          m = v > m ? v : m;
        }
        double s = 0.0, sum_zc = 0.0;
        for (int64_t j = 0; j < V; ++j) {
          const float v = soft(zr(j));
          s += std::exp(double(v) - double(m));
          sum_zc += v;
        }
        const float lse = nan ? std::numeric_limits<float>::quiet_NaN() : float(double(m) + std::log(s));
        const float zy = soft(zr(y));
        lr = (1.0f - eps) * (lse - zy) + eps * (lse - float(sum_zc / double(V))) + p.z_loss * lse * lse;
        if (!gr) continue;
        const float k1 = 1.0f + 2.0f * p.z_loss * lse, k0 = eps / float(V), rs = static_cast<const float*>(row_scale.data)[r];
        for (int64_t j = 0; j < V; ++j) {
          const float v = soft(zr(j));
          float d = std::exp(v - lse) * k1 - k0 - (j == y ? 1.0f - eps : 0.0f);
          if (cap > 0.0f) d *= 1.0f - (v / cap) * (v / cap);
          gr[j] = store_val<S>(d * rs);
        }
      }
    });
  };
  dispatch_floating(z.dtype, "linear_cross_entropy_logits_grad: z", [&](auto ztag) {
    using Z = typename decltype(ztag)::type;
    const Z* zin = static_cast<const Z*>(z.data);
    if (!g.defined()) return rows(zin, static_cast<float*>(nullptr));
    dispatch_floating(g.dtype, "linear_cross_entropy_logits_grad: g", [&](auto tag) {
      using S = typename decltype(tag)::type;
      rows(zin, static_cast<S*>(g.data));
    });
  });
}

}  // namespace detail
}  // namespace mmfuse
