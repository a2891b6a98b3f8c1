// All schemas of the mmfuse torch library: the single source of truth for names and defaults.
// Each family is a fragment whose fake (meta) implementations live in python/mmfuse/<family>.py.
#include <torch/library.h>

#include "mmfuse/common.h"
#include "view.h"

// Debug overrides of the CUDA backends' path choices, for tests and benchmarks (mmfuse/common.h).
TORCH_LIBRARY(mmfuse, m) {
  m.def("_set_path_override(str name, str value) -> ()", [](std::string name, std::string value) {
    mmfuse::torch_bind::guarded("_set_path_override", [&] { mmfuse::set_path_override(name, value); });
  });
}

// Rotary family (python/mmfuse/rope.py). Angles: (cos, sin) tables [A, B, L, D], or integer
// positions [A, B, L] with fp32 inv_freq [D/2]. numerics: "fp32" or "hf_eager". heads_first: 4-D q/k
// are [B, H, L, D] (HF) instead of [B, L, H, D].
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.rope");
  m.def(
      "mrope(Tensor q, Tensor k, Tensor? cos, Tensor? sin, Tensor? positions, Tensor? inv_freq, "
      "int[] mrope_section=[], bool interleaved=False, str numerics=\"fp32\", bool heads_first=False) -> (Tensor, Tensor)");
  m.def(
      "mrope_backward(Tensor grad_q, Tensor grad_k, Tensor? cos, Tensor? sin, Tensor? positions, "
      "Tensor? inv_freq, int[] mrope_section=[], bool interleaved=False, str numerics=\"fp32\", bool heads_first=False) -> (Tensor, Tensor)");
  m.def(
      "mrope_(Tensor(a!) q, Tensor(b!) k, Tensor? cos, Tensor? sin, Tensor? positions, Tensor? inv_freq, "
      "int[] mrope_section=[], bool interleaved=False, str numerics=\"fp32\", bool backward=False, bool heads_first=False) -> ()");
  m.def(
      "mrope_out(Tensor q, Tensor k, Tensor? cos, Tensor? sin, Tensor? positions, Tensor? inv_freq, "
      "int[] mrope_section, bool interleaved, str numerics, bool backward, bool heads_first, Tensor(a!) q_out, Tensor(b!) k_out) -> ()");
  m.def("vision_rope(Tensor q, Tensor k, Tensor freqs) -> (Tensor, Tensor)");
  m.def("vision_rope_backward(Tensor grad_q, Tensor grad_k, Tensor freqs) -> (Tensor, Tensor)");
}

// Position preprocessing (python/mmfuse/positions.py). mode: "qwen" (transformers 4.49-4.51), "hf4"
// (4.52-4.57) or "hf5" (5.x; needs mm_token_type_ids). Outputs: position_ids [3, B, L] int64, deltas
// [B, 1] int64. Vision ops: sizes come from a host copy of grid_thw (a device grid costs one copy);
// outputs on `device` (default: that of grid_thw / inv_freq).
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.positions");
  m.def(
      "rope_index(Tensor input_ids, Tensor? image_grid_thw=None, Tensor? video_grid_thw=None, "
      "Tensor? second_per_grid_ts=None, Tensor? attention_mask=None, int spatial_merge_size=2, "
      "int image_token_id=151655, int video_token_id=151656, int vision_start_token_id=151652, "
      "float tokens_per_second=2.0, str mode=\"qwen\", Tensor? mm_token_type_ids=None) -> (Tensor, Tensor)");
  // vision_positions: (row, col) of each patch, int64 [N, 2]; rot_pos_emb: fp32 [N, 2F] angles.
  m.def("vision_positions(Tensor grid_thw, int spatial_merge_size=2, Device? device=None) -> Tensor");
  m.def("rot_pos_emb(Tensor inv_freq, Tensor grid_thw, int spatial_merge_size=2) -> Tensor");
  // window_index: (window_index, cu_window_seqlens, reverse_index, cu_seqlens), SEMANTICS.md section 4.
  m.def(
      "window_index(Tensor grid_thw, int spatial_merge_size=2, int window_size=112, int patch_size=14, "
      "Device? device=None) -> (Tensor, Tensor, Tensor, Tensor)");
}

// MoE token routing (python/mmfuse/moe.py), SEMANTICS.md section 5. moe_plan: (row_id_map int32 [K, T],
// counts int64 [E], dst_to_src int32 [num_out]); moe_sort_plan: moe_plan's row_id_map without an expert
// count (a radix sort of the ids); moe_permute: x rows in routing order, num_rows of them
// (differentiable in x); moe_unpermute: the probability-weighted sum back per token (differentiable in
// y and probs); moe_unpermute_backward: (dy, dprobs), dprobs [T, K] or [0] without compute_dprobs.
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.moe");
  m.def("moe_plan(Tensor indices, int num_experts, int num_out_tokens=0) -> (Tensor, Tensor, Tensor)");
  m.def("moe_sort_plan(Tensor indices, int num_out_tokens=0) -> Tensor");
  m.def("moe_permute(Tensor x, Tensor row_id_map, SymInt num_rows) -> Tensor");
  m.def("moe_unpermute(Tensor y, Tensor row_id_map, Tensor? probs=None) -> Tensor");
  m.def("moe_unpermute_backward(Tensor dout, Tensor y, Tensor row_id_map, Tensor? probs=None, "
        "bool compute_dprobs=True) -> (Tensor, Tensor)");
}

// Dual-expert GEMM (python/mmfuse/dual_gemm.py), SEMANTICS.md section 6: out_e = op(a_e) @ op(w_e)
// for e in {0, 1}. dual_gemm: new outputs in the input dtype, or float32 with out_fp32 (differentiable
// in all four inputs); dual_gemm_out: into pre-allocated contiguous outputs, accumulate adds (fp32).
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.dual_gemm");
  m.def("dual_gemm(Tensor a0, Tensor w0, Tensor a1, Tensor w1, bool trans_a=False, bool trans_b=False, "
        "bool out_fp32=False) -> (Tensor, Tensor)");
  m.def("dual_gemm_out(Tensor a0, Tensor w0, Tensor a1, Tensor w1, Tensor(a!) out0, Tensor(b!) out1, "
        "bool trans_a=False, bool trans_b=False, bool accumulate=False) -> ()");
}

// FP8 linear (python/mmfuse/fp8.py), SEMANTICS.md section 7. state: float32 [history + 2] amax state
// (include/mmfuse/fp8.h), mutated (unused per row). fp8_quantize: (q [pad16(R), pad16(C)], qt
// [pad16(C), pad16(R)], scale_inv: [1] or per row [pad16(R)], scale_inv_t: per row [pad16(C)] (qt's),
// else empty), empty where not asked for; with swiglu_q, swiglu_scale_inv (swiglu_pack_fp8 of a [gate
// | up] tensor [R, 2C]) x is the gradient of its swiglu and the tensor quantized the [gate | up]
// gradient [R, 2C]. fp8_transpose: q [R16, C16] -> its transpose [C16, R16], the same bytes. fp8_gemm: (a @ b^T) * scale_a * scale_b (+ bias), a [M, K16],
// b [N16, K16] fp8, scales both [1] or per row -> [M, N16] bf16 (or fp32); fp8_gemm_out: into out
// [m, n], m <= M, n <= N16. fp8_linear_forward: (y, x_qt, x_qt_scale_inv, w_q, w_qt, w_q_scale_inv,
// w_qt_scale_inv (per row only)), the w outputs empty when w's cached copies are given; swiglu_x: x
// is [M, 2K] gate | up and the layer's input is swiglu(x) (per tensor only).
// fp8_linear_backward (k: in_features; x_scale_inv, w_scale_inv: the scales of x_qt, w_qt): (dx, dw,
// db), empty where not needed (dw also when accumulated into main_grad); swiglu_q, swiglu_scale_inv
// (swiglu_pack_fp8 of the layer's [gate | up] output [M, 2C]): g is the gradient of its swiglu [M, C]
// and the output gradient quantized is the [gate | up] one (swiglu_backward_fp8's, never written).
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.fp8");
  m.def("fp8_quantize(Tensor x, Tensor(a!) state, bool rowwise=True, bool transposed=False, bool e5m2=False, "
        "bool dynamic=True, bool per_row=False, Tensor? swiglu_q=None, Tensor? swiglu_scale_inv=None) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_transpose(Tensor q) -> Tensor");
  m.def("fp8_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, bool out_fp32=False, "
        "bool fast_accum=True) -> Tensor");
  m.def("fp8_gemm_out(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor(a!) out, bool accumulate=False, "
        "bool fast_accum=False) -> ()");
  m.def("fp8_linear_forward(Tensor x, Tensor w, Tensor? bias, Tensor(a!) x_state, Tensor(b!) w_state, "
        "Tensor? w_q=None, Tensor? w_qt=None, Tensor? w_scale_inv=None, bool dynamic=True, bool save_xt=True, "
        "bool save_wt=True, bool per_row=False, bool swiglu_x=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor)");
  m.def("fp8_linear_backward(Tensor g, Tensor x_qt, Tensor x_scale_inv, Tensor w_qt, Tensor w_scale_inv, "
        "Tensor(a!) g_state, SymInt k, bool dynamic=True, bool e5m2=True, bool need_dx=True, bool need_dw=True, "
        "bool need_db=False, bool dw_fp32=False, Tensor(b!)? main_grad=None, Tensor? x=None, bool per_row=False, "
        "Tensor? swiglu_q=None, Tensor? swiglu_scale_inv=None) -> (Tensor, Tensor, Tensor)");
}

// Residual add + RMSNorm (python/mmfuse/rms_norm.py; include/mmfuse/rms_norm.h): (out, h, rstd), h
// [0, H] where neither a residual nor a grouped x makes one; the grouping (seq_len > 0) orders a
// grouped tensor's rows by token type. rms_norm_backward: (dx, dresidual ([0, H] unless x_grouped),
// dweight float32).
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.rms_norm");
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, int seq_len=0, int split=0, "
        "bool x_grouped=False, bool out_grouped=False) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor dout, Tensor? dh, Tensor h, Tensor rstd, Tensor weight, int seq_len=0, "
        "int split=0, bool x_grouped=False, bool out_grouped=False) -> (Tensor, Tensor, Tensor)");
}

// SwiGLU on the fused [gate | up] layout (python/mmfuse/swiglu.py; include/mmfuse/swiglu.h):
// swiglu_backward -> (d_gate_up, y recomputed: [0, I] unless recompute); swiglu_backward_ in place:
// gate_up becomes d_gate_up and (recompute) dy becomes y; swiglu_pack_fp8 -> (q e4m3, scale_inv [T, tiles])
// and swiglu_backward_fp8 from those (the input saved in one byte an element).
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.swiglu");
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor dy, Tensor gate_up, bool recompute=True) -> (Tensor, Tensor)");
  m.def("swiglu_backward_(Tensor(a!) dy, Tensor(b!) gate_up, bool recompute=True) -> ()");
  m.def("swiglu_pack_fp8(Tensor gate_up) -> (Tensor, Tensor)");
  m.def("swiglu_backward_fp8(Tensor dy, Tensor q, Tensor scale_inv, bool recompute=True) -> (Tensor, Tensor)");
}

// Fused linear cross-entropy (python/mmfuse/linear_cross_entropy.py, where its CPU and CUDA
// implementations are, as chunks of GEMMs and reductions): (loss: a scalar, or [T] with
// reduction="none"; and with compute_grads for "mean" / "sum" the gradients d_hidden, d_weight (weight's
// dtype, rounded once from fp32 sums; dw_fp32 false: accumulated in it), d_bias (fp32), else empty).
// softcap 0: none. fp32_logits false: the logits in hidden's dtype.
TORCH_LIBRARY_FRAGMENT(mmfuse, m) {
  m.set_python_module("mmfuse.linear_cross_entropy");
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, int ignore_index, "
        "str reduction, float label_smoothing, float z_loss, float softcap, int chunk_tokens, bool compute_grads, "
        "bool fp32_logits=True, bool dw_fp32=True) -> (Tensor, Tensor, Tensor, Tensor)");
  // one chunk's fp32 logits -> (loss [C] fp32, the gradient of sum(row_scale * loss) w.r.t. the logits
  // [C, V] in g_dtype, or [0, V] without want_grad); include/mmfuse/linear_cross_entropy.h
  m.def("linear_cross_entropy_logits_grad(Tensor z, Tensor labels, Tensor row_scale, int ignore_index, "
        "float label_smoothing, float z_loss, float softcap, ScalarType g_dtype, bool want_grad) -> (Tensor, Tensor)");
  // the same into a caller's g [C, V] (rows of a larger buffer: the weight gradient's GEMM then takes
  // several chunks at once); returns the loss
  m.def("linear_cross_entropy_logits_grad_out(Tensor z, Tensor labels, Tensor row_scale, int ignore_index, "
        "float label_smoothing, float z_loss, float softcap, Tensor(a!) g) -> Tensor");
}
