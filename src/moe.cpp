// MoE routing entry points: validate the views, then call the backend.
#include "mmfuse/moe.h"

#include "common/dispatch.h"

namespace mmfuse {
namespace {

void check_cpu(const char* op, const TensorView& v, const char* name) {
  MMFUSE_CHECK(v.device.type == DeviceType::kCPU, op, ": ", name,
               ": the CUDA backend of the MoE routing is not built yet; expected a CPU tensor, got ",
               device_name(v.device));
}

void check_2d(const char* op, const TensorView& v, const char* name, int64_t rows, int64_t cols) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.ndim == 2 && (rows < 0 || v.shape[0] == rows) && (cols < 0 || v.shape[1] == cols), op, ": ", name,
               ": expected shape [", rows < 0 ? std::string("N") : std::to_string(rows), ", ",
               cols < 0 ? std::string("H") : std::to_string(cols), "], got ", shape_str(v));
  check_cpu(op, v, name);
}

void check_rows_contiguous(const char* op, const TensorView& v, const char* name) {
  MMFUSE_CHECK(v.shape[1] <= 1 || v.stride[1] == 1, op, ": ", name, ": the last dim must be contiguous, got strides [",
               v.stride[0], ", ", v.stride[1], "]");
}

void check_map(const char* op, const TensorView& m, int64_t T, int64_t K) {
  check_2d(op, m, "row_id_map", K, T);
  MMFUSE_CHECK(m.dtype == DType::kInt32, op, ": row_id_map: expected dtype int32, got ", dtype_name(m.dtype));
}

void check_probs(const char* op, const TensorView& p, int64_t T, int64_t K, const char* name = "probs") {
  if (!p.defined()) return;
  check_2d(op, p, name, T, K);
  MMFUSE_CHECK(p.dtype == DType::kFloat32, op, ": ", name, ": expected dtype float32, got ", dtype_name(p.dtype));
}

}  // namespace

void moe_plan(const TensorView& idx, int64_t E, int64_t num_out, TensorView& map, TensorView& counts, TensorView& d2s,
              cudaStream_t stream) {
  (void)stream;
  const char* op = "moe_plan";
  check_2d(op, idx, "indices", -1, -1);
  MMFUSE_CHECK(idx.dtype == DType::kInt32 || idx.dtype == DType::kInt64, op,
               ": indices: expected dtype int32 or int64, got ", dtype_name(idx.dtype));
  const int64_t T = idx.shape[0], K = idx.shape[1];
  MMFUSE_CHECK(E >= 1 && E < (int64_t(1) << 31), op, ": num_experts: expected a positive int32, got ", E);
  MMFUSE_CHECK(T * K < (int64_t(1) << 31), op, ": T * K = ", T * K, ": expected below 2^31 (int32 row_id_map)");
  const int64_t n = num_out == 0 ? T * K : num_out;
  MMFUSE_CHECK(n >= 0 && n <= T * K, op, ": num_out_tokens: expected 0 (all) or in [0, T*K = ", T * K, "], got ",
               num_out);
  check_map(op, map, T, K);
  MMFUSE_CHECK(counts.defined() && counts.dtype == DType::kInt64 && counts.ndim == 1 && counts.shape[0] == E, op,
               ": counts: expected int64 [", E, "], got ", dtype_name(counts.dtype), " ", shape_str(counts));
  MMFUSE_CHECK(d2s.defined() && d2s.dtype == DType::kInt32 && d2s.ndim == 1 && d2s.shape[0] == n, op,
               ": dst_to_src: expected int32 [", n, "], got ", dtype_name(d2s.dtype), " ", shape_str(d2s));
  check_cpu(op, counts, "counts");
  check_cpu(op, d2s, "dst_to_src");
  detail::moe_plan_cpu(idx, E, n, map, counts, d2s);
}

void moe_permute(const TensorView& x, const TensorView& d2s, int64_t K, TensorView& out, cudaStream_t stream) {
  (void)stream;
  const char* op = "moe_permute";
  check_2d(op, x, "x", -1, -1);
  check_rows_contiguous(op, x, "x");
  MMFUSE_CHECK(K >= 1, op, ": topk: expected >= 1, got ", K);
  MMFUSE_CHECK(d2s.defined() && d2s.dtype == DType::kInt32 && d2s.ndim == 1, op,
               ": dst_to_src: expected int32 [N], got ", dtype_name(d2s.dtype), " ", shape_str(d2s));
  check_cpu(op, d2s, "dst_to_src");
  check_2d(op, out, "out", d2s.shape[0], x.shape[1]);
  check_rows_contiguous(op, out, "out");
  MMFUSE_CHECK(out.dtype == x.dtype, op, ": out: expected dtype ", dtype_name(x.dtype), " (that of x), got ",
               dtype_name(out.dtype));
  detail::moe_permute_cpu(x, d2s, K, out);
}

void moe_unpermute(const TensorView& y, const TensorView& map, const TensorView& probs, TensorView& out,
                   cudaStream_t stream) {
  (void)stream;
  const char* op = "moe_unpermute";
  check_2d(op, y, "y", -1, -1);
  MMFUSE_CHECK(map.defined() && map.ndim == 2, op, ": row_id_map: expected [K, T], got ", shape_str(map));
  const int64_t K = map.shape[0], T = map.shape[1], H = y.shape[1];
  check_map(op, map, T, K);
  check_probs(op, probs, T, K);
  check_2d(op, out, "out", T, H);
  MMFUSE_CHECK(out.dtype == y.dtype, op, ": out: expected dtype ", dtype_name(y.dtype), " (that of y), got ",
               dtype_name(out.dtype));
  detail::moe_unpermute_cpu(y, map, probs, out);
}

void moe_unpermute_backward(const TensorView& dout, const TensorView& y, const TensorView& map,
                            const TensorView& probs, TensorView& dy, TensorView& dprobs, cudaStream_t stream) {
  (void)stream;
  const char* op = "moe_unpermute_backward";
  check_2d(op, y, "y", -1, -1);
  MMFUSE_CHECK(map.defined() && map.ndim == 2, op, ": row_id_map: expected [K, T], got ", shape_str(map));
  const int64_t K = map.shape[0], T = map.shape[1], N = y.shape[0], H = y.shape[1];
  check_map(op, map, T, K);
  check_probs(op, probs, T, K);
  check_2d(op, dout, "dout", T, H);
  check_2d(op, dy, "dy", N, H);
  for (const auto& [v, name] : {std::pair<const TensorView*, const char*>{&dout, "dout"},
                                std::pair<const TensorView*, const char*>{&dy, "dy"}})
    MMFUSE_CHECK(v->dtype == y.dtype, op, ": ", name, ": expected dtype ", dtype_name(y.dtype), " (that of y), got ",
                 dtype_name(v->dtype));
  check_probs(op, dprobs, T, K, "dprobs");
  detail::moe_unpermute_backward_cpu(dout, y, map, probs, dy, dprobs);
}

}  // namespace mmfuse
