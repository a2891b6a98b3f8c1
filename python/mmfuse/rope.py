"""Rotary position embeddings: text RoPE / mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and vision 2-D RoPE.

Functional API, fake (meta) implementations of the ``torch.ops.mmfuse`` rotary ops, and their
documentation. Autograd is registered in C++ (``bindings/torch/rope.cpp``) and saves only the angle
source (positions + inv_freq, or the cos/sin tables, or the vision freqs), never q or k.
"""

from typing import Optional, Sequence, Tuple

import torch

from . import _lib  # noqa: F401  (registers the ops)

Tensor = torch.Tensor

_ops = torch.ops.mmfuse
_mrope = _ops.mrope.default
_mrope_inplace = _ops.mrope_.default
_vision_rope = _ops.vision_rope.default

_LAYOUTS = ("bhld", "blhd", "thd")
_fast_mrope = getattr(_lib.fast, "mrope", None)
_is_compiling = torch.compiler.is_compiling
_tf_mode = torch._C._is_torch_function_mode_enabled


def _plain(t) -> bool:
    return t is None or type(t) is Tensor


def _direct(q, k, cos, sin, positions, inv_freq) -> bool:
    """Eager call on plain tensors with no torch-function mode: the C++ entry point (same op, less
    argument parsing) is safe. Under torch.compile and for tensor subclasses, torch.ops is used."""
    return (_fast_mrope is not None and type(q) is Tensor and type(k) is Tensor and _plain(cos) and _plain(sin)
            and _plain(positions) and _plain(inv_freq) and not _is_compiling() and not _tf_mode())


def _check_layout(op: str, q: Tensor, k: Optional[Tensor], qk_layout: str) -> None:
    """q and k of the rank their layout has: 4-D for "bhld" / "blhd", 3-D for "thd"."""
    if qk_layout not in _LAYOUTS:
        raise ValueError(f"{op}: qk_layout: expected one of {_LAYOUTS}, got {qk_layout!r}")
    want = 3 if qk_layout == "thd" else 4
    dims = {"bhld": "[B, H, L, D]", "blhd": "[B, L, H, D]", "thd": "[T, H, D]"}[qk_layout]
    for name, t in (("q", q), ("k", k)):
        if t is not None and t.dim() != want:
            raise ValueError(f"{op}: {name}: expected a {want}-D tensor {dims} (qk_layout={qk_layout!r}), got "
                             f"{t.dim()}-D {tuple(t.shape)}")


def mrope(
    q: Tensor,
    k: Tensor,
    cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None,
    *,
    positions: Optional[Tensor] = None,
    inv_freq: Optional[Tensor] = None,
    mrope_section: Optional[Sequence[int]] = None,
    interleaved: bool = False,
    numerics: str = "fp32",
    qk_layout: str = "bhld",
) -> Tuple[Tensor, Tensor]:
    r"""Applies (multimodal) rotary position embeddings to ``q`` and ``k`` in one launch.

    With ``h = D/2``, for each token, head and half-channel ``j < h`` (NeoX "rotate half")::

        out[j]   = x[j]   * cos[j]   - x[j+h] * sin[j]
        out[j+h] = x[j+h] * cos[j+h] + x[j]   * sin[j+h]

    which is HF's ``q * cos + rotate_half(q) * sin``.

    Args:
        q, k: ``[B, H, L, D]`` (``qk_layout="bhld"``, HF), ``[B, L, H, D]`` (``"blhd"``) or
            ``[T, H, D]`` (``"thd"``); bf16, fp16, fp32 (fp64 on the CPU for gradcheck). Token and head
            strides are free, the last dim must be contiguous; ``D`` even, at most 1024.
        cos, sin: HF tables ``[3, B, L, D]`` (mRoPE, what ``Qwen2_5_VLRotaryEmbedding`` returns) or
            ``[B, L, D]`` (plain RoPE), in q's dtype or fp32. A batch dim of 1 broadcasts.
        positions: instead of tables, integer positions ``[3, B, L]`` / ``[3, T]`` (mRoPE) or
            ``[B, L]`` / ``[T]`` (plain), int32 or int64, with ``inv_freq`` ``[D/2]`` float32. The kernel
            computes ``angle = float(pos) * inv_freq[j]`` and ``sincosf(angle)``, equal bit for bit to
            ``torch.cos`` / ``torch.sin`` on the GPU, with no cos/sin tensors in memory.
        mrope_section: ``[s_t, s_h, s_w]`` half-channel counts summing to ``D/2`` (Qwen2/2.5-VL:
            ``[16, 24, 24]``); half-channel ``j`` takes axis T if ``j < s_t``, H if ``j < s_t + s_h``,
            else W, and channel ``j + D/2`` the same axis (HF's ``mrope_section * 2`` is list
            repetition). ``None``: plain RoPE (axis 0 only).
        interleaved: Qwen3-VL layout (``mrope_section`` e.g. ``[24, 20, 20]``): ``j`` takes H if
            ``j % 3 == 1 and j < 3*s_h``, W if ``j % 3 == 2 and j < 3*s_w``, else T.
        numerics: ``"fp32"`` (default): fp32 cos/sin and math, separate multiply and add, one rounding
            at the end; bitwise equal to the HF formula evaluated on fp32 upcasts
            (``(q.float()*cos.float() + rotate_half(q.float())*sin.float()).to(q.dtype)``).
            ``"hf_eager"``: cos/sin rounded to q's dtype, each multiply and add rounded to q's dtype:
            bitwise equal to HF's eager bf16/fp16 code. Backward follows the same rule per mode.
        qk_layout: see ``q, k``.

    Returns:
        ``(q_out, k_out)``, new tensors of the shapes and layouts of ``q`` and ``k``. Differentiable in
        ``q`` and ``k``; the angles must not require grad.
    """
    _check_layout("mmfuse.mrope", q, k, qk_layout)
    section = list(mrope_section) if mrope_section else []
    if _direct(q, k, cos, sin, positions, inv_freq):
        return _fast_mrope(q, k, cos, sin, positions, inv_freq, section, interleaved, numerics, qk_layout == "bhld")
    return _mrope(q, k, cos, sin, positions, inv_freq, section, interleaved, numerics, qk_layout == "bhld")


def mrope_(
    q: Tensor,
    k: Tensor,
    cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None,
    *,
    positions: Optional[Tensor] = None,
    inv_freq: Optional[Tensor] = None,
    mrope_section: Optional[Sequence[int]] = None,
    interleaved: bool = False,
    numerics: str = "fp32",
    qk_layout: str = "bhld",
    backward: bool = False,
) -> None:
    """In-place :func:`mrope` (``backward=True`` applies the adjoint, i.e. the gradient map).

    The schema marks ``q`` and ``k`` as mutated (``Tensor(a!)``), so ``torch.compile`` orders it
    correctly, and their version counters move, so that autograd refuses a stale saved copy. Not
    differentiable: with grad mode on, q or k requiring grad is an error (the rotation's gradient would
    be lost; use :func:`mrope`). q and k must not share memory (their shared elements would rotate
    twice), nor be expanded.
    """
    _check_layout("mmfuse.mrope_", q, k, qk_layout)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k)):
        raise RuntimeError("mmfuse.mrope_: q or k requires grad, and the in-place rotation is not differentiable "
                           "(its gradient would be lost): use mmfuse.mrope, or call mrope_ under torch.no_grad()")
    _mrope_inplace(q, k, cos, sin, positions, inv_freq, mrope_section or (), interleaved, numerics, backward,
                   qk_layout == "bhld")
    for t in (q, k):
        if t is not None:
            torch.autograd.graph.increment_version(t)


def vision_rope(q: Tensor, k: Tensor, freqs: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Vision 2-D RoPE of the Qwen2.5-VL vision tower, on ``q`` and ``k`` in one launch.

    Args:
        q, k: ``[N, H, D]`` (``D = 80`` in Qwen2.5-VL), bf16 / fp16 / fp32; last dim contiguous.
        freqs: ``[N, D/2]`` float32, the tower's ``rotary_pos_emb``: ``[row*inv_freq | col*inv_freq]``
            per patch (see ``SEMANTICS.md`` section 4).

    Channel ``i`` of patch ``n`` uses ``angle = freqs[n, i mod D/2]``, cos/sin by ``sincosf``, fp32
    math with separate multiply and add and one rounding: bitwise equal to HF's
    ``apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())`` with ``emb = cat(freqs, freqs)``.

    Returns:
        ``(q_out, k_out)``; differentiable in ``q`` and ``k`` (the backward saves only ``freqs``).
    """
    return _vision_rope(q, k, freqs)


# ---- fake (meta) implementations: output shapes for torch.compile / FakeTensor ----------------

@torch.library.register_fake("mmfuse::mrope")
def _mrope_fake(q, k, cos, sin, positions, inv_freq, mrope_section=(), interleaved=False, numerics="fp32",
                heads_first=False):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("mmfuse::mrope_backward")
def _mrope_backward_fake(grad_q, grad_k, cos, sin, positions, inv_freq, mrope_section=(), interleaved=False,
                         numerics="fp32", heads_first=False):
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


@torch.library.register_fake("mmfuse::mrope_")
def _mrope_inplace_fake(q, k, cos, sin, positions, inv_freq, mrope_section=(), interleaved=False,
                        numerics="fp32", backward=False, heads_first=False):
    return None


@torch.library.register_fake("mmfuse::mrope_out")
def _mrope_out_fake(q, k, cos, sin, positions, inv_freq, mrope_section, interleaved, numerics, backward,
                    heads_first, q_out, k_out):
    return None


@torch.library.register_fake("mmfuse::vision_rope")
def _vision_rope_fake(q, k, freqs):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("mmfuse::vision_rope_backward")
def _vision_rope_backward_fake(grad_q, grad_k, freqs):
    return torch.empty_like(grad_q), torch.empty_like(grad_k)
