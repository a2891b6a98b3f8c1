// CPU backend of the MoE routing: a counting sort for the plan (stable by construction), row copies
// for permute, fp32 (fp64) accumulation in k order for unpermute and its backward.
#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>
#include <vector>

#include "common/dispatch.h"
#include "backends/moe.h"
#include "mmfuse/moe.h"

namespace mmfuse {
namespace detail {
namespace {

int32_t& map_at(TensorView& m, int64_t k, int64_t t) {
  return static_cast<int32_t*>(m.data)[k * m.stride[0] + t * m.stride[1]];
}
int32_t map_at(const TensorView& m, int64_t k, int64_t t) {
  return static_cast<const int32_t*>(m.data)[k * m.stride[0] + t * m.stride[1]];
}

// The destination row of (t, k), checked against the rows of y.
int64_t row_of(const char* op, const TensorView& m, int64_t k, int64_t t, int64_t rows) {
  const int64_t r = map_at(m, k, t);
  MMFUSE_CHECK(r >= -1 && r < rows, op, ": row_id_map[", k, "][", t, "] = ", r, ": expected -1 or a row of y in [0, ",
               rows, ")");
  return r;
}

}  // namespace

void moe_plan_cpu(const TensorView& idx, int64_t E, int64_t n, TensorView& map, TensorView& counts,
                  TensorView& d2s) {
  const int64_t T = idx.shape[0], K = idx.shape[1];
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = index_at(idx, t, k);
      MMFUSE_CHECK(e >= 0 && e < E, "moe_plan: indices[", t, "][", k, "] = ", e, ": expected an expert id in [0, ", E,
                   ")");
      ++start[e + 1];
    }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  int64_t* C = static_cast<int64_t*>(counts.data);
  for (int64_t e = 0; e < E; ++e) {  // kept rows: the part of [start[e], start[e+1]) below n
    const int64_t lo = std::min(start[e], n), hi = std::min(start[e + 1], n);
    C[e * counts.stride[0]] = hi - lo;
  }
  int32_t* D = static_cast<int32_t*>(d2s.data);
  for (int64_t t = 0; t < T; ++t)  // flat order t*K + k: stable within an expert
    for (int64_t k = 0; k < K; ++k) {
      const int64_t dst = start[index_at(idx, t, k)]++;
      const bool kept = dst < n;
      map_at(map, k, t) = kept ? int32_t(dst) : -1;
      if (kept) D[dst * d2s.stride[0]] = int32_t(t * K + k);
    }
}

void moe_sort_plan_cpu(const TensorView& idx, int64_t n, TensorView& map) {
  const int64_t T = idx.shape[0], K = idx.shape[1];
  std::vector<std::pair<int64_t, int32_t>> entries(size_t(T * K));  // (id, flat index t*K + k)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = index_at(idx, t, k);
      MMFUSE_CHECK(e >= 0 && e <= INT32_MAX, "moe_sort_plan: indices[", t, "][", k, "] = ", e,
                   ": expected an expert id in [0, 2^31)");
      entries[size_t(t * K + k)] = {e, int32_t(t * K + k)};
    }
  // by id, then flat index (the pairs are unique): the counting sort's order, for any id range
  std::sort(entries.begin(), entries.end());
  for (int64_t r = 0; r < T * K; ++r) {
    const int32_t i = entries[size_t(r)].second;
    map_at(map, i % K, i / K) = r < n ? int32_t(r) : -1;
  }
}

void moe_permute_cpu(const TensorView& x, const TensorView& map, TensorView& out) {
  const int64_t T = x.shape[0], K = map.shape[0], N = out.shape[0];
  const size_t es = dtype_size(x.dtype), row = size_t(x.shape[1]) * es;
  const char* X = static_cast<const char*>(x.data);
  char* O = static_cast<char*>(out.data);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row_of("moe_permute", map, k, t, N);
      if (r >= 0) std::memcpy(O + r * out.stride[0] * es, X + t * x.stride[0] * es, row);
    }
}

void moe_unpermute_cpu(const TensorView& y, const TensorView& map, const TensorView& probs, TensorView& out) {
  const int64_t K = map.shape[0], T = map.shape[1], H = y.shape[1], N = y.shape[0];
  dispatch_floating(y.dtype, "moe_unpermute: y", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = typename compute_type<S>::type;
    const S* Y = static_cast<const S*>(y.data);
    S* O = static_cast<S*>(out.data);
    std::vector<C> acc(static_cast<size_t>(H));
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), C(0));
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = row_of("moe_unpermute", map, k, t, N);
        if (r < 0) continue;
        const C w = probs.defined() ? C(static_cast<const float*>(probs.data)[t * probs.stride[0] + k * probs.stride[1]])
                                    : C(1);
        for (int64_t h = 0; h < H; ++h) {
          volatile C p = w * load_val(Y[r * y.stride[0] + h * y.stride[1]]);  // separate multiply and add
          acc[h] += p;
        }
      }
      for (int64_t h = 0; h < H; ++h) O[t * out.stride[0] + h * out.stride[1]] = store_val<S>(acc[h]);
    }
  });
}

void moe_unpermute_backward_cpu(const TensorView& dout, const TensorView& y, const TensorView& map,
                                const TensorView& probs, TensorView& dy, TensorView& dprobs) {
  const int64_t K = map.shape[0], T = map.shape[1], H = y.shape[1], N = y.shape[0];
  dispatch_floating(y.dtype, "moe_unpermute_backward: y", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = typename compute_type<S>::type;
    const S* Y = static_cast<const S*>(y.data);
    const S* G = static_cast<const S*>(dout.data);
    S* DY = static_cast<S*>(dy.data);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t h = 0; h < H; ++h) DY[r * dy.stride[0] + h * dy.stride[1]] = store_val<S>(C(0));
    std::vector<bool> covered(static_cast<size_t>(N), false);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = row_of("moe_unpermute_backward", map, k, t, N);
        float* dp = dprobs.defined()
                        ? static_cast<float*>(dprobs.data) + t * dprobs.stride[0] + k * dprobs.stride[1]
                        : nullptr;
        if (r < 0) {
          if (dp) *dp = 0.0f;
          continue;
        }
        MMFUSE_CHECK(!covered[r], "moe_unpermute_backward: row_id_map: row ", r,
                     " is the destination of two entries (the second: [", k, "][", t, "])");
        covered[r] = true;
        const C w = probs.defined() ? C(static_cast<const float*>(probs.data)[t * probs.stride[0] + k * probs.stride[1]])
                                    : C(1);
        C dot = 0;
        for (int64_t h = 0; h < H; ++h) {
          const C g = load_val(G[t * dout.stride[0] + h * dout.stride[1]]);
          volatile C p = g * load_val(Y[r * y.stride[0] + h * y.stride[1]]);
          dot += p;
          DY[r * dy.stride[0] + h * dy.stride[1]] = store_val<S>(w * g);
        }
        if (dp) *dp = float(dot);
      }
  });
}

}  // namespace detail
}  // namespace mmfuse
