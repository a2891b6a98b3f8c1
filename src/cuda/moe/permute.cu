// MoE permute: out[row_id_map[k][t]] = x[t], token-centric so that each row of x is read once;
// rows move as the widest vectors (16 bytes down to 1) that their size and alignment allow.
#include "cuda/moe/common.cuh"

namespace mmfuse {
namespace detail {
namespace {

// out[map[k][t]] = x[t]: thread j moves vector j % V of token j / V to its K rows; each x row is
// read once. kPermUnroll vectors a thread are loaded before any store. kStream: streaming stores
// (st.global.cs), which keep the K written copies from evicting the rows still to be read.
template <int B, bool kSmall, int KG, bool kStream>
__global__ void __launch_bounds__(kFlatThreads) moe_permute_kernel(const char* __restrict__ x, int64_t xs,
                                                                   char* __restrict__ out, int64_t os, int64_t N,
                                                                   MapRef map, int64_t T, int64_t K, uint32_t V,
                                                                   FastDiv dv) {
  using U = typename Bytes<B>::type;
  const int64_t total = T * V, step = int64_t(gridDim.x) * kFlatThreads * kPermUnroll;
  BadEntry bad;
  for (int64_t j0 = int64_t(blockIdx.x) * kFlatThreads * kPermUnroll + threadIdx.x; j0 < total; j0 += step) {
    U v[kPermUnroll];
    int64_t t[kPermUnroll], col[kPermUnroll];
#pragma unroll
    for (int u = 0; u < kPermUnroll; ++u) {
      const int64_t j = j0 + int64_t(u) * kFlatThreads;
      t[u] = -1;
      if (j < total) {
        row_col<kSmall>(j, V, dv, t[u], col[u]);
        v[u] = __ldg(reinterpret_cast<const U*>(x + t[u] * xs) + col[u]);
      }
    }
    for (int64_t k = 0; k < K; k += KG) {
      int32_t r[kPermUnroll][KG];
#pragma unroll
      for (int u = 0; u < kPermUnroll; ++u) {
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) r[u][kk] = -1;
        if (t[u] >= 0) load_rows<KG>(map, k, K, t[u], N, r[u], bad);
      }
#pragma unroll
      for (int u = 0; u < kPermUnroll; ++u)
#pragma unroll
        for (int kk = 0; kk < KG; ++kk)
          if (r[u][kk] >= 0) {
            U* dst = reinterpret_cast<U*>(out + int64_t(r[u][kk]) * os) + col[u];
            if constexpr (kStream)
              __stcs(dst, v[u]);
            else
              *dst = v[u];
          }
    }
  }
  if (bad.t >= 0) bad_row("moe_permute", map, bad.k, bad.t, N);
}

}  // namespace

void moe_permute_cuda(const TensorView& x, const TensorView& map, TensorView& out, cudaStream_t stream) {
  const int64_t T = x.shape[0], H = x.shape[1], K = map.shape[0], N = out.shape[0];
  const int64_t es = int64_t(dtype_size(x.dtype)), row = H * es;
  if (T == 0 || H == 0 || K == 0) return;
  const int b = vec_bytes(row, {{x.data, x.stride[0] * es}, {out.data, out.stride[0] * es}});
  const uint32_t V = uint32_t(row / b);
  const bool small = T * V < (int64_t(1) << 31);
  const PermutePath path = permute_path(K);
  dispatch_vec(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    // A block for every kFlatThreads * kPermUnroll vectors (the hardware hands out the work), not a
    // grid-stride loop over a resident grid.
    auto go = [&](auto kgc, auto csc) {
      constexpr int KG = decltype(kgc)::value;
      constexpr bool CS = decltype(csc)::value;
      auto kernel = small ? &moe_permute_kernel<B, true, KG, CS> : &moe_permute_kernel<B, false, KG, CS>;
      kernel<<<flat_blocks(T * V, kPermUnroll, true), kFlatThreads, 0, stream>>>(
          static_cast<const char*>(x.data), x.stride[0] * es, static_cast<char*>(out.data), out.stride[0] * es, N,
          map_ref(map), T, K, V, FastDiv(V));
    };
    if (path.streaming)
      go(std::integral_constant<int, 2>{}, std::true_type{});
    else if (path.k_group == 2)
      go(std::integral_constant<int, 2>{}, std::false_type{});
    else
      go(std::integral_constant<int, 1>{}, std::false_type{});
    MMFUSE_CUDA_CHECK_LAUNCH("moe_permute_kernel");
  });
}

}  // namespace detail
}  // namespace mmfuse
