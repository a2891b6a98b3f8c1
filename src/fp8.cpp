// FP8 entry points: validate the quantize jobs and the GEMM operands, then call the backend.
#include "backends/fp8.h"
#include "mmfuse/fp8.h"

#include <string>

#include "mmfuse/swiglu.h"

#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {
namespace {

bool is_fp8(DType t) { return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2; }

bool contiguous(const TensorView& v) {  // contiguous, any rank (an empty tensor is)
  if (v.numel() == 0) return true;
  int64_t expect = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    if (v.shape[i] != 1 && v.stride[i] != expect) return false;
    expect *= v.shape[i];
  }
  return true;
}

void check_2d(const char* op, const char* name, const TensorView& v, Device dev) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.ndim == 2, op, ": ", name, ": expected a 2-D tensor, got ", shape_str(v));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected a tensor on ", device_name(dev), ", got ",
               device_name(v.device));
}

void check_scalar_f32(const char* op, const char* name, const TensorView& v, Device dev) {
  MMFUSE_CHECK(v.defined(), op, ": ", name, " is missing");
  MMFUSE_CHECK(v.dtype == DType::kFloat32, op, ": ", name, ": expected dtype float32, got ", dtype_name(v.dtype));
  MMFUSE_CHECK(v.numel() == 1, op, ": ", name, ": expected one element, got shape ", shape_str(v));
  MMFUSE_CHECK(v.device == dev, op, ": ", name, ": expected a tensor on ", device_name(dev), ", got ",
               device_name(v.device));
}

void check_vector_f32(const char* op, const char* name, const TensorView& v, int64_t n, Device dev) {
  MMFUSE_CHECK(v.defined() && v.ndim == 1 && v.dtype == DType::kFloat32 && v.shape[0] == n && contiguous(v) &&
                   v.device == dev,
               op, ": ", name, ": expected a contiguous float32 [", n, "] on ", device_name(dev), ", got ",
               v.defined() ? shape_str(v) + " " + dtype_name(v.dtype) : std::string("none"));
}

void check_job(const char* op, const Fp8QuantJob& j, Device dev) {
  check_2d(op, "x", j.src, dev);
  const DType in = j.src.dtype;
  MMFUSE_CHECK(in == DType::kBFloat16 || in == DType::kFloat16 || in == DType::kFloat32, op,
               ": x: expected dtype bfloat16, float16 or float32, got ", dtype_name(in));
  const int64_t r = j.src.shape[0], sc = j.src.shape[1];
  if (r > 0 && sc > 0) {
    MMFUSE_CHECK(sc <= 1 || j.src.stride[1] == 1, op, ": x: the last dim must be contiguous, got strides [",
                 j.src.stride[0], ", ", j.src.stride[1], "]");
    MMFUSE_CHECK(r <= 1 || j.src.stride[0] >= sc, op, ": x: row stride ", j.src.stride[0], " is below its ", sc,
                 " columns");
  }
  if (j.swiglu) {
    MMFUSE_CHECK(sc % 2 == 0, op, ": x: swiglu: expected the [gate | up] layout (an even number of columns), got ",
                 shape_str(j.src));
    MMFUSE_CHECK(!j.per_row, op, ": swiglu: per tensor scaling only (per_row=True is not supported)");
    MMFUSE_CHECK(!j.col_sums.defined(), op, ": swiglu: col_sums is not supported");
  }
  if (j.swiglu_grad) {
    MMFUSE_CHECK(!j.swiglu, op, ": swiglu and swiglu_grad: expected one source kind, got both");
    MMFUSE_CHECK(!j.per_row, op, ": swiglu_grad: per tensor scaling only (per_row=True is not supported)");
    MMFUSE_CHECK(!j.col_sums.defined(), op, ": swiglu_grad: col_sums is not supported");
    check_2d(op, "pack_q", j.pack_q, dev);
    check_2d(op, "pack_scale_inv", j.pack_scale_inv, dev);
    MMFUSE_CHECK(j.pack_q.dtype == DType::kFloat8E4M3 && j.pack_q.shape[0] == r && j.pack_q.shape[1] == 2 * sc &&
                     (r * sc == 0 || j.pack_q.stride[1] == 1),
                 op, ": pack_q: expected float8_e4m3fn [", r, ", ", 2 * sc,
                 "] (swiglu_pack_fp8 of the [gate | up] tensor: twice x's columns) with a contiguous last dim, got ",
                 dtype_name(j.pack_q.dtype), " ", shape_str(j.pack_q));
    const int64_t tiles = swiglu_pack_tiles(2 * sc);
    MMFUSE_CHECK(j.pack_scale_inv.dtype == DType::kFloat32 && j.pack_scale_inv.shape[0] == r &&
                     j.pack_scale_inv.shape[1] == tiles && (r * tiles == 0 || j.pack_scale_inv.stride[1] == 1),
                 op, ": pack_scale_inv: expected float32 [", r, ", ", tiles, "] with a contiguous last dim, got ",
                 dtype_name(j.pack_scale_inv.dtype), " ", shape_str(j.pack_scale_inv));
  }
  const int64_t c = j.swiglu ? sc / 2 : j.swiglu_grad ? 2 * sc : sc;  // the quantized tensor's columns
  MMFUSE_CHECK(j.q.defined() || j.qt.defined(), op, ": expected q, qt or both to write, got neither");
  DType fmt = DType::kFloat32;
  struct Out {
    const TensorView* v;
    const char* name;
    int64_t rows, cols;
  };
  const int64_t rp = fp8_padded(r), cp = fp8_padded(c);
  for (const auto& [v, name, rows, cols] : {Out{&j.q, "q", rp, cp}, Out{&j.qt, "qt", cp, rp}}) {
    if (!v->defined()) continue;
    check_2d(op, name, *v, dev);
    MMFUSE_CHECK(is_fp8(v->dtype), op, ": ", name, ": expected dtype float8_e4m3fn or float8_e5m2, got ",
                 dtype_name(v->dtype));
    MMFUSE_CHECK(fmt == DType::kFloat32 || v->dtype == fmt, op, ": ", name, ": expected dtype ", dtype_name(fmt),
                 " (that of q), got ", dtype_name(v->dtype));
    fmt = v->dtype;
    MMFUSE_CHECK(v->shape[0] == rows && v->shape[1] == cols, op, ": ", name, ": expected shape [", rows, ", ", cols,
                 "] (both dims padded to a multiple of ", kFp8Align, "), got ", shape_str(*v));
    MMFUSE_CHECK(contiguous(*v), op, ": ", name, ": expected a contiguous tensor");
  }
  if (j.per_row) {
    MMFUSE_CHECK(j.dynamic, op, ": per_row: scales per row are always dynamic (dynamic=False is per tensor only)");
    check_vector_f32(op, "scale_inv", j.scale_inv, rp, dev);
    if (j.qt.defined()) check_vector_f32(op, "scale_inv_t", j.scale_inv_t, cp, dev);
    check_vector_f32(op, "scratch", j.scratch, rp + cp, dev);
    return;
  }
  check_scalar_f32(op, "scale_inv", j.scale_inv, dev);
  MMFUSE_CHECK(j.state.defined() && j.state.ndim == 1 && j.state.dtype == DType::kFloat32 && j.state.shape[0] >= 3 &&
                   contiguous(j.state) && j.state.device == dev,
               op, ": state: expected a contiguous float32 [history + 2] buffer (history >= 1) on ", device_name(dev),
               ", got ", j.state.defined() ? shape_str(j.state) + " " + dtype_name(j.state.dtype) : std::string("none"));
}

}  // namespace

float fp8_max(DType fp8) { return fp8 == DType::kFloat8E5M2 ? 57344.0f : 448.0f; }

// one partial sum per 64-row tile of the cast's walk and per column (padded to the 64-column tiles)
int64_t fp8_col_sum_partials(int64_t rows, int64_t cols) {
  auto tiles = [](int64_t n) { return (fp8_padded(n) + 63) / 64; };
  return tiles(rows) * tiles(cols) * 64;
}

void fp8_quantize(Fp8QuantJob* jobs, int num_jobs, cudaStream_t stream) {
  const char* op = "fp8_quantize";
  MMFUSE_CHECK(num_jobs == 1 || num_jobs == 2, op, ": expected 1 or 2 tensors, got ", num_jobs);
  const Device dev = jobs[0].src.device;
  for (int i = 0; i < num_jobs; ++i) {
    check_job(op, jobs[i], dev);
    const Fp8QuantJob& j = jobs[i];
    if (!j.col_sums.defined()) continue;
    MMFUSE_CHECK(num_jobs == 1, op, ": col_sums: only for a single tensor a call");
    check_vector_f32(op, "col_sums", j.col_sums, j.src.shape[1], dev);
    if (dev.type == DeviceType::kCUDA)
      check_vector_f32(op, "partials", j.partials, fp8_col_sum_partials(j.src.shape[0], j.src.shape[1]), dev);
  }
  if (dev.type == DeviceType::kCPU) {
    for (int i = 0; i < num_jobs; ++i) detail::fp8_quantize_cpu(jobs[i]);
    return;
  }
  MMFUSE_CUDA_BACKEND(op, stream, detail::fp8_quantize_cuda(jobs, num_jobs, stream));
}

void fp8_transpose(const TensorView& q, TensorView& qt, cudaStream_t stream) {
  const char* op = "fp8_transpose";
  MMFUSE_CHECK(q.defined(), op, ": q is missing");
  const Device dev = q.device;
  check_2d(op, "q", q, dev);
  check_2d(op, "qt", qt, dev);
  MMFUSE_CHECK(is_fp8(q.dtype), op, ": q: expected dtype float8_e4m3fn or float8_e5m2, got ", dtype_name(q.dtype));
  MMFUSE_CHECK(qt.dtype == q.dtype, op, ": qt: expected q's dtype ", dtype_name(q.dtype), ", got ",
               dtype_name(qt.dtype));
  const int64_t r = q.shape[0], c = q.shape[1];
  MMFUSE_CHECK(r % kFp8Align == 0 && c % kFp8Align == 0, op, ": q: expected both dims multiples of ", kFp8Align,
               " (a padded copy), got ", shape_str(q));
  MMFUSE_CHECK(qt.shape[0] == c && qt.shape[1] == r, op, ": qt: expected shape [", c, ", ", r, "], got ", shape_str(qt));
  MMFUSE_CHECK(contiguous(q) && contiguous(qt), op, ": q and qt: expected contiguous tensors");
  check_not_expanded(op, qt, "qt");
  check_no_overlap(op, qt, "qt", q, "q");
  if (r * c == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::fp8_transpose_cpu(q, qt);
  MMFUSE_CUDA_BACKEND(op, stream, detail::fp8_transpose_cuda(q, qt, stream));
}

int64_t fp8_gemm_workspace_bytes() { return int64_t(32) << 20; }  // cuBLAS's recommendation for Hopper

void fp8_gemm(const TensorView& a, const TensorView& b, const TensorView& scale_a, const TensorView& scale_b,
              const TensorView& bias, TensorView& out, const Fp8GemmOptions& o, TensorView& ws, cudaStream_t stream) {
  const char* op = "fp8_gemm";
  MMFUSE_CHECK(a.defined(), op, ": a is missing");
  const Device dev = a.device;
  check_2d(op, "a", a, dev);
  check_2d(op, "b", b, dev);
  check_2d(op, "out", out, dev);
  for (const auto& [v, name] : {std::pair<const TensorView*, const char*>{&a, "a"}, {&b, "b"}}) {
    MMFUSE_CHECK(is_fp8(v->dtype), op, ": ", name, ": expected dtype float8_e4m3fn or float8_e5m2, got ",
                 dtype_name(v->dtype));
    MMFUSE_CHECK(v->shape[1] % kFp8Align == 0, op, ": ", name, ": expected k (its columns) a multiple of ", kFp8Align,
                 " (fp8_quantize pads it), got shape ", shape_str(*v));
    MMFUSE_CHECK(v != &b || v->shape[0] % kFp8Align == 0, op, ": b: expected n (its rows) a multiple of ", kFp8Align,
                 " (fp8_quantize pads it), got shape ", shape_str(*v));
    MMFUSE_CHECK(contiguous(*v), op, ": ", name, ": expected a contiguous tensor");
  }
  MMFUSE_CHECK(a.dtype == DType::kFloat8E4M3 || b.dtype == DType::kFloat8E4M3, op,
               ": a and b: at most one of them may be float8_e5m2, got both");
  MMFUSE_CHECK(b.shape[1] == a.shape[1], op, ": b: expected ", a.shape[1], " columns (the k of a), got shape ",
               shape_str(b));
  const int64_t m = a.shape[0], n = b.shape[0];
  const bool vec = scale_a.defined() && scale_a.numel() != 1;
  if (vec) {  // per row: scale_a covers a's rows (a padded copy may have more), scale_b b's
    MMFUSE_CHECK(scale_a.ndim == 1 && scale_a.dtype == DType::kFloat32 && scale_a.shape[0] >= m && contiguous(scale_a) &&
                     scale_a.device == dev,
                 op, ": scale_a: expected float32 [1] or a contiguous float32 vector of >= ", m,
                 " (one per row of a), got ", shape_str(scale_a), " ", dtype_name(scale_a.dtype));
    check_vector_f32(op, "scale_b", scale_b, n, dev);
  } else {
    check_scalar_f32(op, "scale_a", scale_a, dev);
    check_scalar_f32(op, "scale_b", scale_b, dev);
  }
  MMFUSE_CHECK(out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat32, op,
               ": out: expected dtype bfloat16 or float32, got ", dtype_name(out.dtype));
  MMFUSE_CHECK(out.shape[0] == m && out.shape[1] == n, op, ": out: expected shape [", m, ", ", n, "], got ",
               shape_str(out));
  const bool empty = m == 0 || n == 0;
  // contiguous: cuBLASLt's fp8 kernels refuse a padded row stride
  MMFUSE_CHECK(empty || contiguous(out), op, ": out: expected a contiguous tensor, got strides [", out.stride[0], ", ",
               out.stride[1], "]");
  MMFUSE_CHECK(!o.accumulate || out.dtype == DType::kFloat32, op, ": accumulate=True needs a float32 out, got ",
               dtype_name(out.dtype));
  if (bias.defined()) {
    MMFUSE_CHECK(!o.accumulate && out.dtype == DType::kBFloat16, op,
                 ": bias: only with a bfloat16 out and accumulate=False");
    MMFUSE_CHECK(a.shape[1] > 0, op, ": bias: not supported with k = 0");
    MMFUSE_CHECK(bias.ndim == 1 && bias.shape[0] == n && bias.dtype == DType::kBFloat16 && contiguous(bias) &&
                     bias.device == dev,
                 op, ": bias: expected a contiguous bfloat16 [", n, "] on ", device_name(dev), ", got ",
                 shape_str(bias), " ", dtype_name(bias.dtype));
  }
  if (dev.type == DeviceType::kCPU) {
    detail::fp8_gemm_cpu(a, b, scale_a, scale_b, bias, out, o);
    return;
  }
  check_workspace(op, ws, dev, fp8_gemm_workspace_bytes());
  MMFUSE_CUDA_BACKEND(op, stream, detail::fp8_gemm_cuda(a, b, scale_a, scale_b, bias, out, o, ws, stream));
}

}  // namespace mmfuse
