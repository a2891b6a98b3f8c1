// FP8 linear building blocks (SEMANTICS.md section 7): the quantize pass and the fp8 GEMM.
//
// Quantize (per tensor): scale = fp8_max / max(amax, 1e-12) (fp8_max: 448 for e4m3, 57344 for e5m2),
// q = saturate_rne(x * scale) (fp32 multiply, round to nearest even, clamped to +-fp8_max; NaN stays
// NaN), scale_inv = 1 / scale (the dequantization factor the GEMM applies). One pass over x writes
// the row-major copy q [pad(R), pad(C)] and / or the transposed copy qt [pad(C), pad(R)] (pad: up to
// a multiple of 16); the padding is zero, so products over a padded k are exact and every operand
// suits the fp8 tensor cores (which want k, n and the leading dimensions in multiples of 16).
//
// Where amax comes from (Fp8ScaleState, owned by the caller, e.g. by a module; never keyed by data
// pointer): a float32 buffer [H + 2]: history[0..H) (the amaxes of the last H calls, newest first),
// then two words of scratch that the kernels leave at zero (a running maximum and a block counter:
// allocate the state zeroed once, and never run two calls on one state concurrently).
//   - dynamic (current scaling): a first pass computes this tensor's amax into history[0] (the older
//     entries shift by one); the cast uses it. Two passes over x, exact scale.
//   - delayed: the cast uses max(history) and records this tensor's amax into the history in the same
//     pass (one pass over x; values beyond the delayed range saturate). A fresh state (history all
//     zero) gets this tensor's amax first, as dynamic scaling would (decided on the device: the amax
//     pass still launches, and returns at once when the history has an entry), so the first call is
//     exact and no caller has to know which call is first.
// Per row (per_row): every row of q gets its own scale (from that row's amax) and every row of qt its
// own (from that column of x's amax): scale_inv [pad(R)] for q and scale_inv_t [pad(C)] for qt; always
// dynamic (no history), the amax pass writing row and column maxima into a caller's zeroed scratch
// [pad(R) + pad(C)]. The GEMM then takes vector scales (per row of a and of b).
// Up to two tensors (e.g. x and w) quantize in one launch (and one amax launch).
// SwiGLU source (swiglu, per tensor only): src is the fused [gate | up] layout [R, 2C] and the tensor
// quantized is swiglu(src) [R, C], each value the swiglu op's own (silu(gate) * up in fp32, rounded
// once to src's dtype), so the copies equal those of quantizing the swiglu op's output, without that
// output ever being written.
// SwiGLU gradient source (swiglu_grad, per tensor only): src is dy [R, C], the gradient of a swiglu
// output, and the tensor quantized is the gradient of its [gate | up] input [R, 2C], each value
// swiglu_backward_fp8's own (gate and up unpacked from swiglu_pack_fp8's pack_q [R, 2C] e4m3 and
// pack_scale_inv [R, tiles]), so the copies equal those of quantizing that op's output, which is
// never written.
//
// GEMM: out [M, N] (+)= (a [M, K] @ b [N, K]^T) * scale_a * scale_b (+ bias [N]), the scales both
// float32 [1] (per tensor) or both vectors, scale_a[i] per row of a (>= M entries) and scale_b[j] per
// row of b (N entries: out[i, j] = acc * scale_a[i] * scale_b[j]), a and b fp8
// (e4m3, or one of them e5m2: the gradient), K and N multiples of 16 (padded copies; a may be the
// first M rows of one), fp32 accumulation (fast accumulation optional, the forward's choice), out
// bf16 (optionally with a bf16 bias) or fp32 (optionally accumulated into: weight-gradient
// accumulation), contiguous.
//
// Backends: CPU (emulation of the same numerics, for tests: the quantize is bitwise equal to the
// CUDA one; the GEMM accumulates in fp32 in k order, so it matches the tensor cores within fp32
// rounding) and CUDA (quantize kernels; cuBLASLt GEMM with device scale pointers, algorithms cached
// per problem, the caller's workspace).
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

constexpr float kFp8AmaxEps = 1e-12f;
constexpr int64_t kFp8Align = 16;  // padding of every fp8 row (elements = bytes)

inline int64_t fp8_padded(int64_t n) { return (n + kFp8Align - 1) / kFp8Align * kFp8Align; }
MMFUSE_API float fp8_max(DType fp8);  // 448 (e4m3) or 57344 (e5m2)

struct Fp8QuantJob {
  TensorView src;        // [R, C] (swiglu: [R, 2C]) bf16, fp16 or fp32, contiguous last dim
  TensorView q;          // optional: [fp8_padded(R), fp8_padded(C)] fp8 (e4m3 / e5m2), contiguous
  TensorView qt;         // optional: [fp8_padded(C), fp8_padded(R)] fp8 of the same format, contiguous
  TensorView scale_inv;    // float32 out, 1 / scale: [1], or per_row [fp8_padded(R)] (the scales of q)
  TensorView scale_inv_t;  // per_row with qt: float32 out [fp8_padded(C)] (the scales of qt)
  TensorView state;        // per tensor: [H + 2] float32 in/out (see above), H >= 1
  TensorView scratch;      // per_row: float32 [fp8_padded(R) + fp8_padded(C)], zero on entry
  // optional, one job only: the column sums of x (fp32, in a fixed order: deterministic), e.g. the
  // bias gradient of the output gradient, from the same pass; on CUDA with a float32 workspace of
  // fp8_col_sum_partials(R, C) elements
  TensorView col_sums;     // float32 [C]
  TensorView partials;
  bool dynamic = true;
  bool per_row = false;
  bool swiglu = false;  // src is [R, 2C] gate | up; the values quantized are swiglu(src) [R, C]
  // swiglu_grad: src is dy [R, C]; the values quantized are the [gate | up] gradient [R, 2C] from the pack
  bool swiglu_grad = false;
  TensorView pack_q;          // swiglu_grad: [R, 2C] float8_e4m3fn, contiguous last dim
  TensorView pack_scale_inv;  // swiglu_grad: [R, swiglu_pack_tiles(2C)] float32, contiguous last dim
};

MMFUSE_API int64_t fp8_col_sum_partials(int64_t rows, int64_t cols);

// jobs: 1 or 2 tensors, all on one device.
MMFUSE_API void fp8_quantize(Fp8QuantJob* jobs, int num_jobs, cudaStream_t stream);

// qt [C, R] = q [R, C]^T, bytes moved as they are (any fp8 format; the scale stays the caller's): the
// transposed copy of a quantized tensor from its row-major one, the same bits as quantizing it
// transposed. R and C multiples of 16 (padded copies), both contiguous and 16-byte aligned.
MMFUSE_API void fp8_transpose(const TensorView& q, TensorView& qt, cudaStream_t stream);

struct Fp8GemmOptions {
  bool accumulate = false;  // out += ..., out float32, no bias
  bool fast_accum = true;   // the tensor cores' fast fp8 accumulation (forward); false: split (backward)
};

// Bytes of the CUDA workspace (contiguous, on the inputs' device; ignored on the CPU).
MMFUSE_API int64_t fp8_gemm_workspace_bytes();

MMFUSE_API void fp8_gemm(const TensorView& a, const TensorView& b, const TensorView& scale_a,
                         const TensorView& scale_b, const TensorView& bias, TensorView& out,
                         const Fp8GemmOptions& options, TensorView& workspace, cudaStream_t stream);

}  // namespace mmfuse
