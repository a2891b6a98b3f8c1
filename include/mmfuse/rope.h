// mmfuse rotary embeddings: text RoPE / mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and vision 2-D RoPE.
//
// Contract: docs SEMANTICS.md sections 1 and 2. Summary:
//
// Text (mrope). q [B, L, Hq, D], k [B, L, Hk, D] ([B, H, L, D] with heads_first, or [T, H, D]; any
// token/head strides, last dim contiguous),
// bf16 / fp16 / fp32 (fp64 for gradient checks). With h = D/2 and half-channel j in [0, h):
//   forward   out[j]   = x[j]*c1   - x[j+h]*s1          (c1, s1: angle table at channel j)
//             out[j+h] = x[j+h]*c2 + x[j]*s2            (c2, s2: angle table at channel j+h)
//   backward  dx[j]    = dy[j]*c1   + dy[j+h]*s2
//             dx[j+h]  = dy[j+h]*c2 - dy[j]*s1
// (for angles from positions c1 == c2 and s1 == s2: a rotation and its inverse). Angles come from
//   - a cos/sin table [A, B, L, D] (A = 3 for mRoPE, 1 for plain RoPE; the HF layout), dtype of q or
//     fp32; channel i of a token reads table axis axis(i mod h), or
//   - integer positions [A, B, L] (int32/int64) and inv_freq [h] (fp32): angle = float(pos)*inv_freq[j],
//     cos/sin by sincosf in the kernel (equal bit for bit to torch.cos / torch.sin on the GPU).
// Axis of half-channel j: plain -> 0; sectioned [s_t, s_h, s_w] (sum h) -> 0 if j < s_t, 1 if
//   j < s_t + s_h, else 2; interleaved (Qwen3-VL) -> 1 if j%3==1 and j < 3*s_h, 2 if j%3==2 and
//   j < 3*s_w, else 0.
// Numerics:
//   kFp32    fp32 cos/sin, fp32 multiplies and adds (no FMA contraction), one rounding at the end.
//            Bitwise equal to the HF formula evaluated on fp32 upcasts and cast back once.
//   kHfEager cos/sin rounded to the input dtype first, then every multiply and add rounded to the
//            input dtype (round-to-nearest-even), exactly as HF's eager PyTorch code in bf16/fp16.
// Outputs may be the very same views as the inputs (in place); partial overlap is rejected.
//
// Vision (vision_rope). q [N, Hq, Dv], k [N, Hk, Dv]; freqs [N, Dv/2] fp32 (HF's rotary_pos_emb:
// [row*inv_freq | col*inv_freq]); channel i uses angle freqs[n, i mod Dv/2], cos/sin by sincosf, fp32
// math with separate multiply and add, one rounding: bitwise equal to HF apply_rotary_pos_emb_vision.
#pragma once

#include "mmfuse/common.h"

namespace mmfuse {

enum class RopeLayout : int8_t { kPlain, kSectioned, kInterleaved };
enum class RopeNumerics : int8_t { kFp32, kHfEager };

struct RopeParams {
  RopeLayout layout = RopeLayout::kPlain;
  int section[3] = {0, 0, 0};  // half-channel counts per axis (sectioned / interleaved)
  RopeNumerics numerics = RopeNumerics::kFp32;
  bool backward = false;       // apply the adjoint (gradient) instead of the rotation
  bool heads_first = false;    // 4-D q/k (and outputs) are [B, H, L, D] (HF) rather than [B, L, H, D]
};

// Angle source: exactly one of (cos, sin), (positions, inv_freq) or freqs is defined.
struct RopeAngles {
  TensorView cos;        // [A, B, L, D], dtype of q or fp32
  TensorView sin;        // [A, B, L, D]
  TensorView positions;  // [A, B, L] int32 / int64
  TensorView inv_freq;   // [D/2] fp32
  TensorView freqs;      // [B, L, D/2] fp32 angles (plain layout; the vision tower's rotary_pos_emb)
};

// Text RoPE / mRoPE on q and k in one launch (k may be absent: ndim -1). Views as above; q_out and
// k_out have the shapes of q and k. Runs on `stream` for CUDA views; ignores it for CPU views.
MMFUSE_API void mrope(const TensorView& q, const TensorView& k, const RopeAngles& angles,
                      const RopeParams& params, TensorView& q_out, TensorView& k_out,
                      cudaStream_t stream);

// Vision 2-D RoPE (forward or, with backward = true, its adjoint) on q and k.
MMFUSE_API void vision_rope(const TensorView& q, const TensorView& k, const TensorView& freqs,
                            bool backward, TensorView& q_out, TensorView& k_out,
                            cudaStream_t stream);

// Axis (0, 1, 2) of half-channel j: the section rule above. Pure host function.
MMFUSE_API int rope_axis(const RopeParams& params, int j);

// Rows (token, head) one CUDA thread stages in shared memory at once, at most.
constexpr int kRopeMaxRowsInFlight = 8;

// Launch shape of the CUDA kernel (pure host function, unit-tested on the host).
struct RopeLaunch {
  int vec;              // elements per access (16 bytes where alignment allows)
  int chunks;           // vectors per half head: D / 2 / vec
  int tokens_per_block; // tokens of one block; a thread owns one token and one vector
  int threads;          // tokens_per_block * chunks
  int heads_per_group;  // (token, head) rows of one thread: heads of q then k, split into groups
  int head_groups;      // grid y
  int rows_in_flight;   // rows a thread stages in shared memory at once (<= kRopeMaxRowsInFlight)
  int64_t blocks;       // grid x
};
// heads: Hq + Hk; max_vec: the largest elements-per-access that the pointers and strides allow
// (a power of two).
MMFUSE_API RopeLaunch rope_launch_shape(int64_t tokens, int heads, int head_dim, int elem_size, int max_vec);

}  // namespace mmfuse
