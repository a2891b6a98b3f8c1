// MoE routing entry points: validate the views, then call the CPU or CUDA backend.
#include "backends/moe.h"
#include "mmfuse/moe.h"

#include <algorithm>
#include <string>

#include "common/dispatch.h"

namespace mmfuse {
namespace {

void check_device(const char* op, const TensorView& v, const char* name, Device dev) {
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected a tensor on ", device_name(dev), " (that of the first "
               "argument), got ", device_name(v.device));
}

void check_2d(const char* op, const TensorView& v, const char* name, int64_t rows, int64_t cols, Device dev) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.ndim == 2 && (rows < 0 || v.shape[0] == rows) && (cols < 0 || v.shape[1] == cols), op, ": ", name,
               ": expected shape [", rows < 0 ? std::string("N") : std::to_string(rows), ", ",
               cols < 0 ? std::string("H") : std::to_string(cols), "], got ", shape_str(v));
  check_device(op, v, name, dev);
}

// A [rows, cols] tensor of rows (-1: any): the last dim contiguous, fewer than 2^31 rows.
void check_rows(const char* op, const TensorView& v, const char* name, int64_t rows, int64_t cols, Device dev) {
  check_2d(op, v, name, rows, cols, dev);
  MMFUSE_CHECK(v.shape[1] <= 1 || v.stride[1] == 1, op, ": ", name, ": the last dim must be contiguous, got strides [",
               v.stride[0], ", ", v.stride[1], "]");
  MMFUSE_CHECK(v.shape[0] < (int64_t(1) << 31), op, ": ", name, ": ", v.shape[0],
               " rows: expected below 2^31 (int32 row_id_map)");
}

void check_map(const char* op, const TensorView& m, int64_t T, int64_t K, Device dev) {
  check_2d(op, m, "row_id_map", K, T, dev);
  MMFUSE_CHECK(m.dtype == DType::kInt32, op, ": row_id_map: expected dtype int32, got ", dtype_name(m.dtype));
}

// A map that gives K (and T, unless T >= 0 is given) to the other arguments.
void check_map(const char* op, const TensorView& m, Device dev, int64_t T = -1) {
  MMFUSE_CHECK(m.defined() && m.ndim == 2, op, ": row_id_map: expected [K, T], got ", shape_str(m));
  check_map(op, m, T < 0 ? m.shape[1] : T, m.shape[0], dev);
}

void check_probs(const char* op, const TensorView& p, int64_t T, int64_t K, Device dev, const char* name = "probs") {
  if (!p.defined()) return;
  check_2d(op, p, name, T, K, dev);
  MMFUSE_CHECK(p.dtype == DType::kFloat32, op, ": ", name, ": expected dtype float32, got ", dtype_name(p.dtype));
}

void check_same_dtype(const char* op, const TensorView& v, const char* name, const TensorView& ref,
                      const char* ref_name) {
  MMFUSE_CHECK(v.dtype == ref.dtype, op, ": ", name, ": expected dtype ", dtype_name(ref.dtype), " (that of ",
               ref_name, "), got ", dtype_name(v.dtype));
}

void check_workspace(const char* op, const TensorView& ws, int64_t need, Device dev) {
  if (dev.type != DeviceType::kCUDA) return;
  MMFUSE_CHECK(ws.defined() && ws.dtype == DType::kInt32 && ws.ndim == 1 && ws.shape[0] >= need &&
                   (ws.shape[0] <= 1 || ws.stride[0] == 1),
               op, ": workspace: expected a contiguous int32 [>= ", need, "], got ", dtype_name(ws.dtype), " ",
               shape_str(ws));
  check_device(op, ws, "workspace", dev);
}

// The plans' common arguments: indices [T, K] int32 / int64, num_out_tokens, row_id_map [K, T];
// returns the rows kept.
int64_t check_plan_args(const char* op, const TensorView& idx, int64_t num_out, const TensorView& map) {
  MMFUSE_CHECK(idx.defined(), op, ": indices is missing");
  const Device dev = idx.device;
  check_2d(op, idx, "indices", -1, -1, dev);
  MMFUSE_CHECK(idx.dtype == DType::kInt32 || idx.dtype == DType::kInt64, op,
               ": indices: expected dtype int32 or int64, got ", dtype_name(idx.dtype));
  const int64_t T = idx.shape[0], K = idx.shape[1];
  MMFUSE_CHECK(T * K < (int64_t(1) << 31), op, ": T * K = ", T * K, ": expected below 2^31 (int32 row_id_map)");
  const int64_t n = num_out == 0 ? T * K : num_out;
  MMFUSE_CHECK(n >= 0 && n <= T * K, op, ": num_out_tokens: expected 0 (all) or in [0, T*K = ", T * K, "], got ",
               num_out);
  check_map(op, map, T, K, dev);
  return n;
}

}  // namespace

namespace detail {
int64_t moe_plan_block_entries(int64_t tk, int64_t E) {
  // tile: a block's walk of one tile a warp (8 warps x 32 lanes x 2 ids). Blocks sum all chunks'
  // histogram columns, so the chunk count C is bounded to keep C * E (and the C * C * E reads) small;
  // 2^14 cells keep one tile a warp up to E = 256 at T*K = 32K.
  constexpr int64_t tile = 512, max_cells = 1 << 14, max_blocks = 1024;
  const int64_t c_max = std::max<int64_t>(1, std::min(max_blocks, max_cells / std::max<int64_t>(E, 1)));
  const int64_t tiles = (tk + tile - 1) / tile;
  return tile * std::max<int64_t>(1, (tiles + c_max - 1) / c_max);
}
}  // namespace detail

int64_t moe_plan_workspace_size(int64_t T, int64_t K, int64_t E) {
  // a chunk's histogram: E int32, or (the CUDA plan's narrow rows) E rounded up to 8 uint16
  const int64_t tk = T * K, per = detail::moe_plan_block_entries(tk, E);
  return std::max<int64_t>(1, (tk + per - 1) / per) * std::max<int64_t>({E, (E + 7) / 8 * 4, 1});
}

int64_t moe_unpermute_backward_workspace_size(int64_t rows) { return std::max<int64_t>(1, rows); }

void moe_plan(const TensorView& idx, int64_t E, int64_t num_out, TensorView& map, TensorView& counts, TensorView& d2s,
              TensorView& ws, cudaStream_t stream) {
  const char* op = "moe_plan";
  const int64_t n = check_plan_args(op, idx, num_out, map);
  const Device dev = idx.device;
  const int64_t T = idx.shape[0], K = idx.shape[1];
  MMFUSE_CHECK(E >= 1 && E < (int64_t(1) << 31), op, ": num_experts: expected a positive int32, got ", E);
  MMFUSE_CHECK(dev.type != DeviceType::kCUDA || E <= kMoeMaxExpertsCuda, op, ": num_experts: expected at most ",
               kMoeMaxExpertsCuda, " on CUDA, got ", E);
  MMFUSE_CHECK(counts.defined() && counts.dtype == DType::kInt64 && counts.ndim == 1 && counts.shape[0] == E, op,
               ": counts: expected int64 [", E, "], got ", dtype_name(counts.dtype), " ", shape_str(counts));
  MMFUSE_CHECK(d2s.defined() && d2s.dtype == DType::kInt32 && d2s.ndim == 1 && d2s.shape[0] == n, op,
               ": dst_to_src: expected int32 [", n, "], got ", dtype_name(d2s.dtype), " ", shape_str(d2s));
  check_device(op, counts, "counts", dev);
  check_device(op, d2s, "dst_to_src", dev);
  check_workspace(op, ws, moe_plan_workspace_size(T, K, E), dev);
  if (dev.type == DeviceType::kCPU) return detail::moe_plan_cpu(idx, E, n, map, counts, d2s);
  MMFUSE_CUDA_BACKEND(op, stream, detail::moe_plan_cuda(idx, E, n, map, counts, d2s, ws, stream));
}

int64_t moe_sort_plan_workspace_size(int64_t T, int64_t K) {
#ifdef MMFUSE_WITH_CUDA
  return std::max<int64_t>(1, detail::moe_sort_plan_workspace_cuda(T * K));
#else
  (void)T, (void)K;
  return 1;
#endif
}

void moe_sort_plan(const TensorView& idx, int64_t num_out, TensorView& map, TensorView& ws, cudaStream_t stream) {
  const char* op = "moe_sort_plan";
  const int64_t n = check_plan_args(op, idx, num_out, map);
  const Device dev = idx.device;
  const int64_t T = idx.shape[0], K = idx.shape[1];
  if (T * K == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::moe_sort_plan_cpu(idx, n, map);
  check_workspace(op, ws, moe_sort_plan_workspace_size(T, K), dev);
  MMFUSE_CUDA_BACKEND(op, stream, detail::moe_sort_plan_cuda(idx, n, map, ws, stream));
}

void moe_permute(const TensorView& x, const TensorView& map, TensorView& out, cudaStream_t stream) {
  const char* op = "moe_permute";
  MMFUSE_CHECK(x.defined(), op, ": x is missing");
  const Device dev = x.device;
  check_rows(op, x, "x", -1, -1, dev);
  check_map(op, map, dev, x.shape[0]);
  check_rows(op, out, "out", -1, x.shape[1], dev);
  check_same_dtype(op, out, "out", x, "x");
  if (dev.type == DeviceType::kCPU) return detail::moe_permute_cpu(x, map, out);
  MMFUSE_CUDA_BACKEND(op, stream, detail::moe_permute_cuda(x, map, out, stream));
}

void moe_unpermute(const TensorView& y, const TensorView& map, const TensorView& probs, TensorView& out,
                   cudaStream_t stream) {
  const char* op = "moe_unpermute";
  MMFUSE_CHECK(y.defined(), op, ": y is missing");
  const Device dev = y.device;
  check_rows(op, y, "y", -1, -1, dev);
  check_map(op, map, dev);
  const int64_t K = map.shape[0], T = map.shape[1], H = y.shape[1];
  check_probs(op, probs, T, K, dev);
  check_rows(op, out, "out", T, H, dev);
  check_same_dtype(op, out, "out", y, "y");
  if (dev.type == DeviceType::kCPU) return detail::moe_unpermute_cpu(y, map, probs, out);
  MMFUSE_CUDA_BACKEND(op, stream, detail::moe_unpermute_cuda(y, map, probs, out, stream));
}

void moe_unpermute_backward(const TensorView& dout, const TensorView& y, const TensorView& map,
                            const TensorView& probs, TensorView& dy, TensorView& dprobs, TensorView& ws,
                            cudaStream_t stream) {
  const char* op = "moe_unpermute_backward";
  MMFUSE_CHECK(y.defined(), op, ": y is missing");
  const Device dev = y.device;
  check_rows(op, y, "y", -1, -1, dev);
  check_map(op, map, dev);
  const int64_t K = map.shape[0], T = map.shape[1], N = y.shape[0], H = y.shape[1];
  check_probs(op, probs, T, K, dev);
  check_rows(op, dout, "dout", T, H, dev);
  check_rows(op, dy, "dy", N, H, dev);
  check_same_dtype(op, dout, "dout", y, "y");
  check_same_dtype(op, dy, "dy", y, "y");
  check_probs(op, dprobs, T, K, dev, "dprobs");
  check_workspace(op, ws, moe_unpermute_backward_workspace_size(N), dev);
  if (dev.type == DeviceType::kCPU) return detail::moe_unpermute_backward_cpu(dout, y, map, probs, dy, dprobs);
  MMFUSE_CUDA_BACKEND(op, stream, detail::moe_unpermute_backward_cuda(dout, y, map, probs, dy, dprobs, ws, stream));
}

}  // namespace mmfuse
