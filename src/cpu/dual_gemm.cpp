// CPU backend of the dual-expert GEMM: one product at a time, rows in parallel, fp32 (fp64)
// accumulation in k order (a dot product an output when w is [n, k], a row of accumulators when it is
// [k, n]), rounded once.
#include <algorithm>
#include <vector>

#include "common/dispatch.h"
#include "common/parallel.h"
#include "backends/dual_gemm.h"
#include "mmfuse/dual_gemm.h"

namespace mmfuse {
namespace detail {

void gemm_cpu(const TensorView& a, const TensorView& w, TensorView& out, const DualGemmOptions& o) {
  const int64_t m = out.shape[0], n = out.shape[1], k = o.trans_a ? a.shape[0] : a.shape[1];
  dispatch_floating(a.dtype, "dual_gemm: a", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = typename compute_type<S>::type;
    const S* A = static_cast<const S*>(a.data);
    const S* W = static_cast<const S*>(w.data);
    // element (i, kk) of op(a)
    auto a_at = [&](int64_t i, int64_t kk) { return o.trans_a ? A[kk * a.stride[0] + i] : A[i * a.stride[0] + kk]; };
    // rows in parallel: each thread owns whole rows of out, so the sums are the same at any thread count
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, n * k));
    parallel_for(m, grain, [&](int64_t i0, int64_t i1) {
      std::vector<C> acc(static_cast<size_t>(n));
      for (int64_t i = i0; i < i1; ++i) {
        if (o.trans_b) {  // w's rows are contiguous in k: dot products, kBlk outputs at a time, k in order
          constexpr int64_t kBlk = 8;
          for (int64_t j0 = 0; j0 < n; j0 += kBlk) {
            const int64_t nb = std::min(kBlk, n - j0);
            C sum[kBlk] = {};
            for (int64_t kk = 0; kk < k; ++kk) {
              const C x = load_val(a_at(i, kk));
              for (int64_t u = 0; u < nb; ++u) sum[u] += x * load_val(W[(j0 + u) * w.stride[0] + kk]);
            }
            for (int64_t u = 0; u < nb; ++u) acc[j0 + u] = sum[u];
          }
        } else {  // w's rows are contiguous in n: a row of accumulators, k in order
          std::fill(acc.begin(), acc.end(), C(0));
          for (int64_t kk = 0; kk < k; ++kk) {
            const C x = load_val(a_at(i, kk));
            const S* wk = W + kk * w.stride[0];
            for (int64_t j = 0; j < n; ++j) acc[j] += x * load_val(wk[j]);
          }
        }
        auto write = [&](auto* O) {
          using T = std::remove_pointer_t<decltype(O)>;
          for (int64_t j = 0; j < n; ++j) {
            T& dst = O[i * n + j];
            if constexpr (std::is_same_v<T, S>) {
              dst = o.accumulate ? store_val<S>(load_val(dst) + acc[j]) : store_val<S>(acc[j]);
            } else {  // fp32 output of a narrower input
              dst = o.accumulate ? dst + float(acc[j]) : float(acc[j]);
            }
          }
        };
        if (out.dtype == a.dtype)
          write(static_cast<S*>(out.data));
        else
          write(static_cast<float*>(out.data));
      }
    });
  });
}

}  // namespace detail
}  // namespace mmfuse
