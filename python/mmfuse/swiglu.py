"""SwiGLU on the fused gate/up layout: ``silu(gate) * up`` from one ``[..., 2I]`` tensor (the output of
one GEMM against the stacked ``[gate; up]`` weights), fp32 math rounded once, and a backward that
recomputes the activation instead of storing it. Contract: ``include/mmfuse/swiglu.h``.
"""

import math
from typing import Tuple

import torch
from torch import Tensor

from . import _lib  # noqa: F401  (registers the ops)


def swiglu(gate_up: Tensor) -> Tensor:
    r"""``y = silu(gate) * up`` where ``gate = gate_up[..., :I]`` and ``up = gate_up[..., I:]``.

    Args:
        gate_up: ``[..., 2I]`` bf16, fp16 or fp32 (fp64 on the CPU); any strides (a contiguous last dim
            reads fastest).

    Returns:
        ``[..., I]`` in gate_up's dtype. Differentiable; the backward saves only ``gate_up``.
    """
    if gate_up.dim() == 0:
        raise ValueError("mmfuse.swiglu: gate_up: expected [..., 2I], got a 0-d tensor")
    shape = gate_up.shape
    y = torch.ops.mmfuse.swiglu(gate_up.reshape(math.prod(shape[:-1]), shape[-1]))
    return y.view(*shape[:-1], shape[-1] // 2)


def swiglu_backward(dy: Tensor, gate_up: Tensor, recompute: bool = True) -> Tuple[Tensor, Tensor]:
    """``(d_gate_up, y)``: the gradient of :func:`swiglu` for 2-D ``dy [T, I]`` and ``gate_up [T, 2I]``,
    and (``recompute``) the forward's output again, bit for bit (else an empty ``[0, I]``)."""
    return torch.ops.mmfuse.swiglu_backward(dy, gate_up, recompute)


def swiglu_backward_(dy: Tensor, gate_up: Tensor, recompute: bool = True) -> None:
    """In-place :func:`swiglu_backward`: ``gate_up`` becomes ``d_gate_up`` and (``recompute``) ``dy``
    becomes ``y``, so a backward that owns both (an autograd function's saved gate/up output and the
    gradient it computed) needs no new ``[T, 2I]`` or ``[T, I]`` buffer. Both 2-D with a contiguous
    last dim; not differentiable; their version counters move, so that autograd refuses a stale saved
    copy of either."""
    torch.ops.mmfuse.swiglu_backward_(dy, gate_up, recompute)
    torch.autograd.graph.increment_version(gate_up)
    if recompute:
        torch.autograd.graph.increment_version(dy)


# Columns a scale of swiglu_pack_fp8 covers (include/mmfuse/swiglu.h kSwigluPackTile).
PACK_TILE = 128


def swiglu_pack_fp8(gate_up: Tensor) -> Tuple[Tensor, Tensor]:
    """The SwiGLU input kept for the backward in one byte an element: ``gate_up [T, 2I]`` (bf16, fp16 or
    fp32) -> ``(q [T, 2I] float8_e4m3fn, scale_inv [T, ceil(2I / 128)] float32)``, each row's 128-column
    tile scaled by its own power of two (the largest that keeps the tile's finite amax within 448), so
    ``q.float() * scale_inv`` (per tile) is ``gate_up`` rounded once to e4m3. Not differentiable."""
    return torch.ops.mmfuse.swiglu_pack_fp8(gate_up)


def swiglu_backward_fp8(dy: Tensor, q: Tensor, scale_inv: Tensor, recompute: bool = True) -> Tuple[Tensor, Tensor]:
    """:func:`swiglu_backward` from :func:`swiglu_pack_fp8`'s output: ``(d_gate_up, y)`` in ``dy``'s dtype,
    the gate and up values unpacked exactly (``y``: empty ``[0, I]`` unless ``recompute``)."""
    return torch.ops.mmfuse.swiglu_backward_fp8(dy, q, scale_inv, recompute)


@torch.library.register_fake("mmfuse::swiglu_pack_fp8")
def _swiglu_pack_fp8_fake(gate_up):
    T, two_i = gate_up.shape
    return (gate_up.new_empty(T, two_i, dtype=torch.float8_e4m3fn),
            gate_up.new_empty(T, -(-two_i // PACK_TILE), dtype=torch.float32))


@torch.library.register_fake("mmfuse::swiglu_backward_fp8")
def _swiglu_backward_fp8_fake(dy, q, scale_inv, recompute=True):
    T, two_i = q.shape
    return dy.new_empty(T, two_i), dy.new_empty(T if recompute else 0, two_i // 2)


@torch.library.register_fake("mmfuse::swiglu")
def _swiglu_fake(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.register_fake("mmfuse::swiglu_backward")
def _swiglu_backward_fake(dy, gate_up, recompute=True):
    T, two_i = gate_up.shape
    return gate_up.new_empty(T, two_i), gate_up.new_empty(T if recompute else 0, two_i // 2)


@torch.library.register_fake("mmfuse::swiglu_backward_")
def _swiglu_backward_inplace_fake(dy, gate_up, recompute=True):
    return None


def _setup_context(ctx, inputs, output):
    (gate_up,) = inputs
    ctx.save_for_backward(gate_up)


def _backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    d_gate_up, _ = torch.ops.mmfuse.swiglu_backward(dy, gate_up, False)
    return d_gate_up


torch.library.register_autograd("mmfuse::swiglu", _backward, setup_context=_setup_context)
