// CPU backend of residual add + RMSNorm: rows in parallel, the weight gradient summed over fixed chunks
// of tokens in order (the same bits on any thread count).
#include <cmath>
#include <vector>

#include "backends/rms_norm.h"
#include "common/dispatch.h"
#include "common/parallel.h"

namespace mmfuse {
namespace detail {
namespace {

constexpr int64_t kChunk = 64;  // tokens a weight-gradient partial sum covers

template <class S>
const S* row_ptr(const TensorView& v, int64_t r) {
  return static_cast<const S*>(v.data) + r * v.stride[0];
}
template <class S>
S* row_ptr(TensorView& v, int64_t r) {
  return static_cast<S*>(v.data) + r * v.stride[0];
}

RowGroups groups_of(const RmsNormGrouping& g, int64_t T) {
  RowGroups r;
  if (g.seq_len > 0) r = {g.seq_len, g.split, T / g.seq_len};
  return r;
}

}  // namespace

void rms_norm_cpu(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
                  const RmsNormGrouping& g, TensorView& out, TensorView& h_out, TensorView& rstd) {
  const int64_t T = x.shape[0], H = x.shape[1];
  const RowGroups rg = groups_of(g, T);
  const bool has_res = residual.defined(), writes_h = has_res || g.x_grouped;
  dispatch_floating(x.dtype, "rms_norm: x", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = typename compute_type<S>::type;
    const S* w = static_cast<const S*>(weight.data);
    parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<C> h(static_cast<size_t>(H));
      for (int64_t t = t0; t < t1; ++t) {
        const S* xr = row_ptr<S>(x, rg.row(t, g.x_grouped));
        C ss = 0;
        for (int64_t j = 0; j < H; ++j) {
          const C v = has_res ? round_to<S>(load_val(xr[j]) + load_val(row_ptr<S>(residual, t)[j])) : load_val(xr[j]);
          h[size_t(j)] = v;
          ss += v * v;
        }
        const C r = C(1) / std::sqrt(ss / C(H) + C(eps));
        static_cast<C*>(rstd.data)[t] = r;
        if (writes_h) {
          S* hr = row_ptr<S>(h_out, t);
          for (int64_t j = 0; j < H; ++j) hr[j] = store_val<S>(h[size_t(j)]);
        }
        S* o = row_ptr<S>(out, rg.row(t, g.out_grouped));
        for (int64_t j = 0; j < H; ++j) o[j] = store_val<S>(load_val(w[j]) * round_to<S>(h[size_t(j)] * r));
      }
    });
  });
}

void rms_norm_backward_cpu(const TensorView& dout, const TensorView& dh, const TensorView& h, const TensorView& rstd,
                           const TensorView& weight, const RmsNormGrouping& g, TensorView& dx, TensorView& dres,
                           TensorView& dweight) {
  const int64_t T = h.shape[0], H = h.shape[1];
  const RowGroups rg = groups_of(g, T);
  dispatch_floating(h.dtype, "rms_norm_backward: h", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = typename compute_type<S>::type;
    const S* w = static_cast<const S*>(weight.data);
    const C* rs = static_cast<const C*>(rstd.data);
    const int64_t chunks = (T + kChunk - 1) / kChunk;
    std::vector<C> partial(size_t(chunks * H), C(0));
    parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<C> gw(static_cast<size_t>(H)), xh(static_cast<size_t>(H));
      for (int64_t c = c0; c < c1; ++c) {
        C* pw = partial.data() + c * H;
        for (int64_t t = c * kChunk; t < std::min(T, (c + 1) * kChunk); ++t) {
          const S* dy = row_ptr<S>(dout, rg.row(t, g.out_grouped));
          const S* hr = row_ptr<S>(h, t);
          const C r = rs[t];
          C dot = 0;
          for (int64_t j = 0; j < H; ++j) {
            const C d = load_val(dy[j]);
            gw[size_t(j)] = d * load_val(w[j]);
            xh[size_t(j)] = load_val(hr[j]) * r;
            dot += gw[size_t(j)] * xh[size_t(j)];
            pw[j] += d * round_to<S>(xh[size_t(j)]);
          }
          const C mean = dot / C(H);
          S* dxr = row_ptr<S>(dx, rg.row(t, g.x_grouped));
          S* drr = g.x_grouped ? row_ptr<S>(dres, t) : nullptr;
          for (int64_t j = 0; j < H; ++j) {
            C v = r * (gw[size_t(j)] - xh[size_t(j)] * mean);
            if (dh.defined()) v += load_val(row_ptr<S>(dh, t)[j]);
            dxr[j] = store_val<S>(v);
            if (drr) drr[j] = store_val<S>(v);
          }
        }
      }
    });
    C* dw = static_cast<C*>(dweight.data);
    for (int64_t j = 0; j < H; ++j) {
      C s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += partial[size_t(c * H + j)];
      dw[j] = s;
    }
  });
}

}  // namespace detail
}  // namespace mmfuse
