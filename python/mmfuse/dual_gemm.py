"""Asymmetric dual-expert GEMM (SEMANTICS.md section 6): two independent products in one call,
``out_e = op(a_e) @ op(w_e)`` for ``e`` in {0, 1}, the experts free to differ in m, n and k.
Differentiable in all four inputs. CPU, and CUDA through cuBLASLt (one matmul an expert on the current
stream, the bigger first, descriptors and algorithms cached per problem, no host sync).
"""

from typing import Optional, Tuple

import torch

from . import _lib  # noqa: F401  (registers the ops)

Tensor = torch.Tensor


def dual_gemm(a0: Tensor, w0: Tensor, a1: Tensor, w1: Tensor, trans_a: bool = False, trans_b: bool = False,
              out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """``(op(a0) @ op(w0), op(a1) @ op(w1))``, accumulated in fp32 (fp64 for fp64) and rounded once.

    Args:
        a0, a1: ``[m_e, k_e]``, or ``[k_e, m_e]`` with ``trans_a`` (the weight-gradient form). Any m
            (0 included: an expert with no tokens).
        w0, w1: ``[k_e, n_e]``, or ``[n_e, k_e]`` with ``trans_b`` (the ``nn.Linear`` layout).
            All four bf16 or fp16 (fp32, and fp64 on the CPU, take a correct slower path), one dtype;
            any strides (an operand whose last dim is not contiguous, or whose rows overlap, is read
            from a dense copy: pass the layout with ``trans_a`` / ``trans_b`` to avoid it).
        out_dtype: None (the inputs' dtype) or ``torch.float32``.

    Returns:
        ``(out0, out1)``, ``[m_e, n_e]``. Gradients reach all four inputs (only those needed are
        computed), in the inputs' dtype.
    """
    if out_dtype not in (None, a0.dtype, torch.float32):
        raise ValueError(f"mmfuse.dual_gemm: out_dtype: expected None, {a0.dtype} or torch.float32, got {out_dtype}")
    return torch.ops.mmfuse.dual_gemm(a0, w0, a1, w1, trans_a, trans_b, out_dtype == torch.float32)


def dual_gemm_out(a0: Tensor, w0: Tensor, a1: Tensor, w1: Tensor, out0: Tensor, out1: Tensor,
                  trans_a: bool = False, trans_b: bool = False, accumulate: bool = False) -> None:
    """In place: ``out_e = op(a_e) @ op(w_e)``, or ``out_e += ...`` with ``accumulate`` (fp32 outputs:
    gradient accumulation). Outputs must be contiguous (ValueError otherwise; nothing is written to a
    temporary). Not differentiable."""
    torch.ops.mmfuse.dual_gemm_out(a0, w0, a1, w1, out0, out1, trans_a, trans_b, accumulate)


def _mn(a, w, trans_a, trans_b):
    return (a.shape[1] if trans_a else a.shape[0], w.shape[0] if trans_b else w.shape[1])


@torch.library.register_fake("mmfuse::dual_gemm")
def _dual_gemm_fake(a0, w0, a1, w1, trans_a=False, trans_b=False, out_fp32=False):
    dt = torch.float32 if out_fp32 else a0.dtype
    return (a0.new_empty(_mn(a0, w0, trans_a, trans_b), dtype=dt), a1.new_empty(_mn(a1, w1, trans_a, trans_b), dtype=dt))


@torch.library.register_fake("mmfuse::dual_gemm_out")
def _dual_gemm_out_fake(a0, w0, a1, w1, out0, out1, trans_a=False, trans_b=False, accumulate=False):
    return None
