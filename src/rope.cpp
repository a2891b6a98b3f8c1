// Rotary family entry points: validate and normalise the views, then call the CPU or CUDA backend.
#include "backends/rope.h"
#include "mmfuse/rope.h"

#include <algorithm>

#include "common/dispatch.h"
#include "common/overlap.h"

namespace mmfuse {
namespace {

constexpr int kMaxHeadDim = 1024;

bool is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16 || t == DType::kFloat16;
}

// [T, H, D] -> [1, T, H, D]; [B, L, H, D] unchanged; [B, H, L, D] (heads_first) -> [B, L, H, D].
TensorView as_blhd(const TensorView& v, bool heads_first, const char* name, const char* op) {
  MMFUSE_CHECK(v.ndim == 3 || v.ndim == 4, op, ": ", name, ": expected 3-D [T, H, D] or 4-D ",
               heads_first ? "[B, H, L, D]" : "[B, L, H, D]", ", got ", v.ndim, "-D ", shape_str(v));
  TensorView r = v;
  if (v.ndim == 4) {
    if (heads_first) {
      std::swap(r.shape[1], r.shape[2]);
      std::swap(r.stride[1], r.stride[2]);
    }
    return r;
  }
  r.ndim = 4;
  for (int i = 3; i >= 1; --i) {
    r.shape[i] = v.shape[i - 1];
    r.stride[i] = v.stride[i - 1];
  }
  r.shape[0] = 1;
  r.stride[0] = 0;
  return r;
}

// Prepends axes of size 1 until the view has `ndim` dims.
TensorView unsqueeze_to(const TensorView& v, int ndim) {
  TensorView r = v;
  int add = ndim - v.ndim;
  if (add <= 0) return r;
  r.ndim = ndim;
  for (int i = ndim - 1; i >= add; --i) {
    r.shape[i] = v.shape[i - add];
    r.stride[i] = v.stride[i - add];
  }
  for (int i = 0; i < add; ++i) {
    r.shape[i] = 1;
    r.stride[i] = 0;
  }
  return r;
}

// Dim d of v must be `want`, or 1 (broadcast: stride set to 0).
void broadcast_dim(TensorView& v, int d, int64_t want, const char* name, const char* dim_name, const char* op) {
  if (v.shape[d] == want) return;
  MMFUSE_CHECK(v.shape[d] == 1, op, ": ", name, ": expected ", dim_name, " = ", want, " (or 1), got ", v.shape[d],
               " in shape ", shape_str(v));
  v.shape[d] = want;
  v.stride[d] = 0;
}

void check_device(const TensorView& v, Device want, const char* name, const char* op) {
  MMFUSE_CHECK(v.device == want, op, ": ", name, ": expected device ", device_name(want), ", got ",
               device_name(v.device));
}

// An output is either the very same view as its input (in place) or shares no element with it, and
// is never expanded.
void check_alias(const TensorView& in, const TensorView& out, const char* in_name, const char* out_name,
                 const char* op) {
  check_not_expanded(op, out, out_name);
  if (in.numel() == 0 || same_view(in, out)) return;
  MMFUSE_CHECK(!views_overlap(in, out), op, ": ", out_name, " partially overlaps ", in_name,
               "; pass the same tensor (in place) or a separate one");
}

// Across q and k: in place, q and k must be separate (else their shared elements would rotate twice);
// out of place, neither output may meet the other input or the other output.
void check_qk_cross(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out,
                    const char* op) {
  if (same_view(q, q_out) && same_view(k, k_out)) {
    MMFUSE_CHECK(!views_overlap(q, k), op, ": q and k share memory: rotated in place, the shared elements would ",
                 "rotate twice; pass separate tensors (or separate outputs)");
    return;
  }
  check_no_overlap(op, q_out, "q_out", k, "k");
  check_no_overlap(op, k_out, "k_out", q, "q");
  check_no_overlap(op, k_out, "k_out", q_out, "q_out");
}

void check_qk_out(const TensorView& x, const TensorView& out, const char* xn, const char* on, const char* op) {
  MMFUSE_CHECK(out.defined(), op, ": ", on, " is missing");
  MMFUSE_CHECK(out.ndim == x.ndim, op, ": ", on, ": expected ", x.ndim, "-D ", shape_str(x), ", got ", shape_str(out));
  for (int i = 0; i < x.ndim; ++i)
    MMFUSE_CHECK(out.shape[i] == x.shape[i], op, ": ", on, ": expected shape ", shape_str(x), ", got ",
                 shape_str(out));
  MMFUSE_CHECK(out.dtype == x.dtype, op, ": ", on, ": expected dtype ", dtype_name(x.dtype), ", got ",
               dtype_name(out.dtype));
  check_device(out, x.device, on, op);
  MMFUSE_CHECK(out.shape[out.ndim - 1] <= 1 || out.stride[out.ndim - 1] == 1, op, ": ", on,
               ": the last dim must be contiguous (stride 1), got stride ", out.stride[out.ndim - 1]);
  check_alias(x, out, xn, on, op);
}

}  // namespace

int rope_axis(const RopeParams& p, int j) {
  switch (p.layout) {
    case RopeLayout::kPlain: return 0;
    case RopeLayout::kSectioned: return j < p.section[0] ? 0 : (j < p.section[0] + p.section[1] ? 1 : 2);
    case RopeLayout::kInterleaved:
      if (j % 3 == 1 && j < 3 * p.section[1]) return 1;
      if (j % 3 == 2 && j < 3 * p.section[2]) return 2;
      return 0;
  }
  return 0;
}

RopeLaunch rope_launch_shape(int64_t tokens, int heads, int head_dim, int elem_size, int max_vec) {
  RopeLaunch s{};
  const int half = head_dim / 2;
  // 8-byte accesses where the half head, the pointers and the strides allow; else narrower (8-byte
  // slots beat 16-byte ones: twice the threads for the same bytes in flight).
  int vec = std::max(1, std::min(max_vec, 8 / elem_size));
  while (vec > 1 && half % vec != 0) vec /= 2;
  s.vec = vec;
  s.chunks = half / vec;
  // About 256 threads a block (up to 512 when one token alone needs more vectors), whole warps
  // where a few more tokens make them so (256 beats 128).
  s.tokens_per_block = std::max(1, 256 / s.chunks);
  for (int t = s.tokens_per_block; t < 2 * s.tokens_per_block && t * s.chunks <= 512; ++t)
    if (t * s.chunks % 32 == 0) {
      s.tokens_per_block = t;
      break;
    }
  s.threads = s.tokens_per_block * s.chunks;
  s.blocks = tokens <= 0 ? 0 : (tokens + s.tokens_per_block - 1) / s.tokens_per_block;
  // Each thread stages up to kRopeMaxRowsInFlight rows (two vectors each) in shared memory, within
  // 48 KB a block.
  const int slot_bytes = vec * elem_size;
  s.rows_in_flight = std::max(1, std::min(kRopeMaxRowsInFlight, 49152 / (2 * s.threads * slot_bytes)));
  // A thread's head group is one batch of rows, all in flight at once.
  s.heads_per_group = std::max(1, std::min(heads, s.rows_in_flight));
  s.head_groups = std::max(1, (heads + s.heads_per_group - 1) / s.heads_per_group);
  return s;
}

void mrope(const TensorView& q_in, const TensorView& k_in, const RopeAngles& a_in, const RopeParams& p,
           TensorView& q_out_in, TensorView& k_out_in, cudaStream_t stream) {
  const char* op = "mrope";
  MMFUSE_CHECK(q_in.defined(), op, ": q is missing");
  MMFUSE_CHECK(is_floating(q_in.dtype), op, ": q: expected dtype bfloat16, float16, float32 or float64, got ",
               dtype_name(q_in.dtype));
  TensorView q = as_blhd(q_in, p.heads_first, "q", op);
  const int64_t B = q.shape[0], L = q.shape[1], D = q.shape[3];
  MMFUSE_CHECK(D >= 2 && D % 2 == 0 && D <= kMaxHeadDim, op, ": q: expected an even head dim in [2, ", kMaxHeadDim,
               "], got ", D);
  MMFUSE_CHECK(q.shape[3] <= 1 || q.stride[3] == 1, op, ": q: the last dim must be contiguous (stride 1), got stride ",
               q.stride[3]);
  const Device dev = q.device;
  check_qk_out(q_in, q_out_in, "q", "q_out", op);
  TensorView q_out = as_blhd(q_out_in, p.heads_first, "q_out", op);

  TensorView k, k_out;
  if (k_in.defined()) {
    MMFUSE_CHECK(k_in.dtype == q_in.dtype, op, ": k: expected dtype ", dtype_name(q_in.dtype), " (that of q), got ",
                 dtype_name(k_in.dtype));
    check_device(k_in, dev, "k", op);
    k = as_blhd(k_in, p.heads_first, "k", op);
    MMFUSE_CHECK(k.shape[0] == B && k.shape[1] == L && k.shape[3] == D, op,
                 ": k: expected the token dims and head dim of q ", shape_str(q_in), ", got ", shape_str(k_in));
    MMFUSE_CHECK(k.shape[3] <= 1 || k.stride[3] == 1, op,
                 ": k: the last dim must be contiguous (stride 1), got stride ", k.stride[3]);
    check_qk_out(k_in, k_out_in, "k", "k_out", op);
    k_out = as_blhd(k_out_in, p.heads_first, "k_out", op);
  } else {
    MMFUSE_CHECK(!k_out_in.defined(), op, ": k_out given without k");
    k = q;
    k.shape[2] = 0;  // no k heads
    k_out = q_out;
    k_out.shape[2] = 0;
  }

  const int64_t half = D / 2;
  const int A = p.layout == RopeLayout::kPlain ? 1 : 3;
  if (p.layout != RopeLayout::kPlain) {
    MMFUSE_CHECK(p.section[0] >= 0 && p.section[1] >= 0 && p.section[2] >= 0, op,
                 ": mrope_section: expected non-negative entries, got [", p.section[0], ", ", p.section[1], ", ",
                 p.section[2], "]");
    const int64_t sum = int64_t(p.section[0]) + p.section[1] + p.section[2];
    MMFUSE_CHECK(sum == half, op, ": mrope_section: expected entries summing to head_dim / 2 = ", half, ", got [",
                 p.section[0], ", ", p.section[1], ", ", p.section[2], "] (sum ", sum, ")");
  }

  RopeAngles a;
  const int sources = int(a_in.cos.defined() || a_in.sin.defined()) + int(a_in.positions.defined() || a_in.inv_freq.defined()) +
                      int(a_in.freqs.defined());
  MMFUSE_CHECK(sources == 1, op, ": expected exactly one angle source: (cos, sin), (positions, inv_freq) or freqs; got ",
               sources);
  if (a_in.cos.defined() || a_in.sin.defined()) {
    MMFUSE_CHECK(a_in.cos.defined() && a_in.sin.defined(), op, ": cos and sin must be given together");
    const char* names[2] = {"cos", "sin"};
    const TensorView* in[2] = {&a_in.cos, &a_in.sin};
    TensorView* out[2] = {&a.cos, &a.sin};
    for (int i = 0; i < 2; ++i) {
      const TensorView& t = *in[i];
      MMFUSE_CHECK(t.dtype == q.dtype || t.dtype == DType::kFloat32, op, ": ", names[i], ": expected dtype ",
                   dtype_name(q.dtype), " (that of q) or float32, got ", dtype_name(t.dtype));
      check_device(t, dev, names[i], op);
      MMFUSE_CHECK(t.ndim >= 3 && t.ndim <= 4, op, ": ", names[i], ": expected [", A, ", B, L, D] (or [B, L, D]), got ",
                   shape_str(t));
      TensorView v = unsqueeze_to(t, 4);
      MMFUSE_CHECK(v.shape[0] == A || (A == 1 && v.shape[0] >= 1), op, ": ", names[i], ": expected ", A,
                   " angle axes in dim 0, got shape ", shape_str(t));
      broadcast_dim(v, 1, B, names[i], "B", op);
      MMFUSE_CHECK(v.shape[2] == L && v.shape[3] == D, op, ": ", names[i], ": expected [", A, ", ", B, ", ", L, ", ", D,
                   "], got ", shape_str(t));
      *out[i] = v;
    }
  } else if (a_in.positions.defined() || a_in.inv_freq.defined()) {
    MMFUSE_CHECK(a_in.positions.defined() && a_in.inv_freq.defined(), op, ": positions and inv_freq must be given together");
    const TensorView& pos = a_in.positions;
    MMFUSE_CHECK(pos.dtype == DType::kInt32 || pos.dtype == DType::kInt64, op,
                 ": positions: expected dtype int32 or int64, got ", dtype_name(pos.dtype));
    check_device(pos, dev, "positions", op);
    MMFUSE_CHECK(pos.ndim >= 1 && pos.ndim <= 3, op, ": positions: expected [", A, ", B, L], [", A,
                 ", T] or [B, L], got ", shape_str(pos));
    TensorView v = pos;
    if (pos.ndim == 2 && q_in.ndim == 3) {  // [A, T] with q [T, H, D]
      v = unsqueeze_to(pos, 3);
      std::swap(v.shape[0], v.shape[1]);
      std::swap(v.stride[0], v.stride[1]);
    } else {
      v = unsqueeze_to(pos, 3);
    }
    MMFUSE_CHECK(v.shape[0] == A || (A == 1 && v.shape[0] >= 1), op, ": positions: expected ", A,
                 " axes in dim 0, got shape ", shape_str(pos));
    broadcast_dim(v, 1, B, "positions", "B", op);
    MMFUSE_CHECK(v.shape[2] == L, op, ": positions: expected ", L, " tokens in the last dim, got shape ", shape_str(pos));
    a.positions = v;
    const TensorView& f = a_in.inv_freq;
    MMFUSE_CHECK(f.dtype == DType::kFloat32, op, ": inv_freq: expected dtype float32, got ", dtype_name(f.dtype),
                 " (angles are never computed in low precision)");
    check_device(f, dev, "inv_freq", op);
    MMFUSE_CHECK(f.ndim == 1 && f.shape[0] == half, op, ": inv_freq: expected shape [", half, "] (head_dim / 2), got ",
                 shape_str(f));
    a.inv_freq = f;
  } else {
    const TensorView& f = a_in.freqs;
    MMFUSE_CHECK(p.layout == RopeLayout::kPlain, op, ": freqs: per-token angles take the plain layout");
    MMFUSE_CHECK(f.dtype == DType::kFloat32, op, ": freqs: expected dtype float32, got ", dtype_name(f.dtype));
    check_device(f, dev, "freqs", op);
    MMFUSE_CHECK(f.ndim == 2 || f.ndim == 3, op, ": freqs: expected [T, ", half, "] or [B, L, ", half, "], got ",
                 shape_str(f));
    TensorView v = unsqueeze_to(f, 3);
    broadcast_dim(v, 0, B, "freqs", "B", op);
    MMFUSE_CHECK(v.shape[1] == L && v.shape[2] == half, op, ": freqs: expected [", B, ", ", L, ", ", half, "], got ",
                 shape_str(f));
    a.freqs = v;
  }

  if (k_in.defined()) check_qk_cross(q_in, k_in, q_out_in, k_out_in, op);
  for (const TensorView* out : {&q_out_in, &k_out_in})
    check_outputs_separate(op, {{out, out == &q_out_in ? "q_out" : "k_out"}},
                           {{&a_in.cos, "cos"}, {&a_in.sin, "sin"}, {&a_in.positions, "positions"},
                            {&a_in.inv_freq, "inv_freq"}, {&a_in.freqs, "freqs"}});

  if (B * L == 0 || q.shape[2] + k.shape[2] == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::mrope_cpu(q, k, a, p, q_out, k_out);
  MMFUSE_CUDA_BACKEND(op, stream, detail::mrope_cuda(q, k, a, p, q_out, k_out, stream));
}

void vision_rope(const TensorView& q, const TensorView& k, const TensorView& freqs, bool backward,
                 TensorView& q_out, TensorView& k_out, cudaStream_t stream) {
  MMFUSE_CHECK(q.ndim == 3, "vision_rope: q: expected 3-D [N, H, D], got ", shape_str(q));
  MMFUSE_CHECK(!k.defined() || k.ndim == 3, "vision_rope: k: expected 3-D [N, H, D], got ", shape_str(k));
  MMFUSE_CHECK(freqs.defined() && freqs.ndim == 2, "vision_rope: freqs: expected 2-D [N, D/2], got ", shape_str(freqs));
  RopeAngles a;
  a.freqs = freqs;
  RopeParams p;
  p.layout = RopeLayout::kPlain;
  p.numerics = RopeNumerics::kFp32;
  p.backward = backward;
  mrope(q, k, a, p, q_out, k_out, stream);
}

}  // namespace mmfuse
