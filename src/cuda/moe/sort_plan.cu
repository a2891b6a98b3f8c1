// The routing plan's row_id_map without an expert count (moe_sort_plan): the ids as 32-bit keys and
// their flat indices as values through a device-wide radix sort (stable: equal ids keep flat order),
// then each sorted position written to its (k, t) slot. No host sync, no bound on the ids: the seed
// API's permute has no expert count, and reading max + 1 would stop the host.
#include <cub/device/device_radix_sort.cuh>

#include "cuda/moe/common.cuh"

namespace mmfuse {
namespace detail {
namespace {

constexpr int kSortPlanThreads = 256;

// Workspace layout (int32 elements): cub's scratch (rounded to 64 elements: 256-byte aligned), then
// keys in, keys out, values in, values out (n each).
struct SortPlanSpace {
  size_t scratch_bytes;
  int64_t scratch_elems;
};

SortPlanSpace sort_plan_space(int64_t n) {
  size_t bytes = 0;
  MMFUSE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                                    static_cast<uint32_t*>(nullptr),
                                                    static_cast<const int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), int(std::max<int64_t>(n, 1))));
  return {bytes, int64_t((bytes + 255) / 256 * 64)};
}

__device__ __noinline__ void bad_sort_id(int64_t t, int64_t k, int64_t e) {
  MMFUSE_DEVICE_FAIL("moe_sort_plan: indices[%lld][%lld] = %lld: expected an expert id in [0, 2^31)", (long long)t,
                     (long long)k, (long long)e);
}

// keys[i] = id of flat entry i = t*K + k, values[i] = i; a negative id or one past int32 stops here.
__global__ void __launch_bounds__(kSortPlanThreads)
    sort_plan_keys_kernel(IndexRef idx, int64_t K, int64_t n, uint32_t* keys, int32_t* values) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / K, k = i - t * K;
    const int64_t off = t * idx.s0 + k * idx.s1;
    const int64_t e = idx.i64 ? static_cast<const int64_t*>(idx.p)[off] : static_cast<const int32_t*>(idx.p)[off];
    if (e < 0 || e > INT32_MAX) {
      bad_sort_id(t, k, e);
      return;
    }
    keys[i] = uint32_t(e);
    values[i] = int32_t(i);
  }
}

// The entry at sorted position r (flat index order[r]) goes to row r, or is dropped past n_keep.
__global__ void __launch_bounds__(kSortPlanThreads)
    sort_plan_map_kernel(const int32_t* order, int64_t K, int64_t n, int64_t n_keep, int32_t* map, int64_t s0,
                         int64_t s1) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < n; r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = order[r], t = i / K, k = i - t * K;
    map[k * s0 + t * s1] = r < n_keep ? int32_t(r) : -1;
  }
}

unsigned sort_plan_grid(int64_t n) {
  const int64_t blocks = (n + kSortPlanThreads - 1) / kSortPlanThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(cuda::sm_count()) * 8)));
}

}  // namespace

int64_t moe_sort_plan_workspace_cuda(int64_t n) { return sort_plan_space(n).scratch_elems + 4 * n; }

void moe_sort_plan_cuda(const TensorView& idx, int64_t n_keep, TensorView& map, TensorView& ws, cudaStream_t stream) {
  const int64_t T = idx.shape[0], K = idx.shape[1], n = T * K;  // 0 < n < 2^31: checked
  const SortPlanSpace s = sort_plan_space(n);
  int32_t* base = static_cast<int32_t*>(ws.data);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base + s.scratch_elems);
  uint32_t* keys_out = keys_in + n;
  int32_t* values_in = reinterpret_cast<int32_t*>(keys_out + n);
  int32_t* values_out = values_in + n;
  const unsigned grid = sort_plan_grid(n);
  sort_plan_keys_kernel<<<grid, kSortPlanThreads, 0, stream>>>(cuda::index_ref(idx), K, n, keys_in, values_in);
  MMFUSE_CUDA_CHECK_LAUNCH("sort_plan_keys_kernel");
  size_t bytes = s.scratch_bytes;
  MMFUSE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base, bytes, keys_in, keys_out, values_in, values_out, int(n), 0,
                                                    32, stream));
  sort_plan_map_kernel<<<grid, kSortPlanThreads, 0, stream>>>(values_out, K, n, n_keep, static_cast<int32_t*>(map.data),
                                                              map.stride[0], map.stride[1]);
  MMFUSE_CUDA_CHECK_LAUNCH("sort_plan_map_kernel");
}

}  // namespace detail
}  // namespace mmfuse
