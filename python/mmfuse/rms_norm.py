"""Residual add + RMSNorm in one pass, with HF's Qwen2 numerics, and an optional grouping of the rows
by token type (the two experts of a VLA layer then read their tokens in place).

``h = x + residual`` (rounded to the dtype, as HF adds), ``out = weight * (h * rsqrt(mean(h^2) + eps))``
with the statistics in fp32 and HF's two roundings (``hidden.to(dtype)``, then ``weight * ...``). The
backward recomputes the normalized row from ``h`` and the saved inverse RMS (no fp32 copy of the input
is kept), and sums the weight gradient in a fixed order (the same bits on every run). Contract:
``include/mmfuse/rms_norm.h``.
"""

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _lib  # noqa: F401  (registers the ops)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Optional[Tensor] = None, *,
             grouping: Optional[Tuple[int, int]] = None, x_grouped: bool = False,
             out_grouped: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""RMSNorm of ``x`` (plus ``residual``) over the last dim.

    Args:
        x: ``[..., H]`` bf16, fp16 or fp32 (fp64 on the CPU); any strides.
        weight: ``[H]``, x's dtype.
        eps: added to the mean square.
        residual: ``[..., H]`` like x, or None. With it the op returns the new residual stream too.
        grouping: ``(seq_len, split)``: the ``T`` rows of x (all leading dims flattened) are ``T /
            seq_len`` samples of ``seq_len`` tokens, the first ``split`` of each of group 0 (e.g. the
            vision-language tokens of a VLA sample), the rest of group 1 (its action tokens). A
            *grouped* tensor holds every sample's group-0 rows first, then every group-1 row, so that
            each group is one contiguous block.
        x_grouped: x's rows are in grouped order (an expert block's output); residual and the returned
            residual stream are always in token order.
        out_grouped: write the normalized rows in grouped order (the experts' input).

    Returns:
        ``out`` (x's shape; grouped rows if ``out_grouped``), or ``(out, h)`` with a residual, ``h =
        x + residual`` in token order: the next residual stream.

    Differentiable in x, residual and weight.
    """
    if x.dim() == 0:
        raise ValueError("mmfuse.rms_norm: x: expected [..., H], got a 0-d tensor")
    H = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), H)
    # a residual of x's shape flattened as x; another reaches the op as it is (its error names the shape)
    r2 = residual.reshape(x2.shape) if residual is not None and residual.shape == x.shape else residual
    seq_len, split = grouping if grouping is not None else (0, 0)
    out, h, _ = torch.ops.mmfuse.rms_norm(x2, r2, weight, float(eps), int(seq_len), int(split), x_grouped, out_grouped)
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, h.view(x.shape)


# ---- fake (meta) kernels and autograd --------------------------------------------------------------

@torch.library.register_fake("mmfuse::rms_norm")
def _rms_norm_fake(x, residual, weight, eps, seq_len=0, split=0, x_grouped=False, out_grouped=False):
    T, H = x.shape
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    writes_h = residual is not None or x_grouped
    return x.new_empty(T, H), x.new_empty(T if writes_h else 0, H), x.new_empty(T, dtype=stat)


@torch.library.register_fake("mmfuse::rms_norm_backward")
def _rms_norm_backward_fake(dout, dh, h, rstd, weight, seq_len=0, split=0, x_grouped=False, out_grouped=False):
    T, H = h.shape
    stat = torch.float64 if h.dtype == torch.float64 else torch.float32
    return h.new_empty(T, H), h.new_empty(T if x_grouped else 0, H), h.new_empty(H, dtype=stat)


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, seq_len, split, x_grouped, out_grouped = inputs
    _, h, rstd = output
    writes_h = residual is not None or x_grouped
    ctx.save_for_backward(h if writes_h else x, rstd, weight)
    ctx.params = (seq_len, split, x_grouped, out_grouped)
    ctx.has_residual = residual is not None
    # an unused output (the new residual after the last layer, rstd always) passes None to the backward,
    # not a zero-filled [T, H] gradient
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dh, _drstd):
    h, rstd, weight = ctx.saved_tensors
    seq_len, split, x_grouped, out_grouped = ctx.params
    if dout is None:
        dout = torch.zeros_like(h)
    if dh is not None and dh.numel() == 0:
        dh = None
    dx, dres, dweight = torch.ops.mmfuse.rms_norm_backward(dout, dh, h, rstd, weight, seq_len, split, x_grouped,
                                                           out_grouped)
    dresidual = None
    if ctx.has_residual:
        dresidual = dres if x_grouped else dx
    return dx, dresidual, dweight.to(weight.dtype), None, None, None, None, None


torch.library.register_autograd("mmfuse::rms_norm", _backward, setup_context=_setup_context)
