"""MoE token routing (SEMANTICS.md section 5): ``moe_permute`` moves each token's rows to its experts
(ascending expert id, then ascending ``(token, k)``: a stable counting sort of the small expert ids),
``moe_unpermute`` brings the expert outputs back, weighted by the routing probabilities, summed in
fp32. Autograd through ``x``, the permuted rows and ``probs``. CPU and CUDA; no host syncs (the CUDA
plan is one or two small launches, each row movement one kernel and its backward three), capturable in
CUDA graphs, deterministic.
"""

from typing import NamedTuple, Optional

import torch

from . import _lib  # noqa: F401  (registers the ops)

Tensor = torch.Tensor


class Permuted(NamedTuple):
    """What :func:`moe_permute` returns."""
    rows: Tensor        # [num_out, H]: x's rows in routing order
    row_id_map: Tensor  # int32 [K, T]: destination row of (t, k), -1 if dropped (the seed's layout)
    counts: Tensor      # int64 [num_experts]: kept rows per expert (on x's device)


def moe_permute(x: Tensor, indices: Tensor, num_experts: int, num_out_tokens: Optional[int] = None) -> Permuted:
    """Rows of ``x`` in routing order: ``rows[d] = x[t]`` for the d-th ``(t, k)`` of the order
    "ascending ``indices[t, k]``, then ascending ``t * K + k``"; the first ``num_out_tokens`` rows of that
    order are kept (None or 0: all ``T * K``), the others dropped (``row_id_map`` -1).

    Args:
        x: ``[T, H]``, any dtype (rows are copied: bf16, fp16, fp32, fp8, ...).
        indices: ``[T, K]`` int32 / int64 expert ids in ``[0, num_experts)``. An id outside that range is
            an error naming it: ValueError on the CPU; on CUDA (where checking on the host would cost a
            sync) the kernel prints the entry and stops with a device-side assertion.
        num_experts: at most 4096 on CUDA.
        num_out_tokens: rows to keep (the first of the routing order); None or 0 keeps all ``T * K``.

    Returns:
        :class:`Permuted` ``(rows, row_id_map, counts)``. Differentiable in ``x`` (the gradient of a
        token is the unweighted sum of its K rows' gradients).
    """
    row_id_map, counts, dst_to_src = torch.ops.mmfuse.moe_plan(indices, num_experts, num_out_tokens or 0)
    return Permuted(torch.ops.mmfuse.moe_permute(x, row_id_map, dst_to_src.shape[0]), row_id_map, counts)


def moe_unpermute(y: Tensor, row_id_map: Tensor, probs: Optional[Tensor] = None) -> Tensor:
    """``out[t] = sum over kept k of probs[t, k] * y[row_id_map[k, t]]`` (weights 1 without ``probs``,
    for every K including 1), accumulated in fp32 (fp64 for fp64) in k order and rounded once to y's dtype.

    Args:
        y: ``[N, H]`` bf16 / fp16 / fp32 / fp64, the expert outputs in routing order.
        row_id_map: int32 ``[K, T]`` from :func:`moe_permute`.
        probs: ``[T, K]`` float32 or None.

    Returns:
        ``[T, H]`` in y's dtype. Differentiable in ``y`` and ``probs`` (``dprobs[t, k] = dot(dout[t],
        y[row])`` in fp32, 0 for dropped entries).
    """
    return torch.ops.mmfuse.moe_unpermute(y, row_id_map, probs)


@torch.library.register_fake("mmfuse::moe_plan")
def _moe_plan_fake(indices, num_experts, num_out_tokens=0):
    T, K = indices.shape
    n = num_out_tokens or T * K
    return (indices.new_empty((K, T), dtype=torch.int32), indices.new_empty((num_experts,), dtype=torch.long),
            indices.new_empty((n,), dtype=torch.int32))


@torch.library.register_fake("mmfuse::moe_sort_plan")
def _moe_sort_plan_fake(indices, num_out_tokens=0):
    T, K = indices.shape
    return indices.new_empty((K, T), dtype=torch.int32)


@torch.library.register_fake("mmfuse::moe_permute")
def _moe_permute_fake(x, row_id_map, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


@torch.library.register_fake("mmfuse::moe_unpermute")
def _moe_unpermute_fake(y, row_id_map, probs=None):
    return y.new_empty((row_id_map.shape[1], y.shape[1]))


@torch.library.register_fake("mmfuse::moe_unpermute_backward")
def _moe_unpermute_backward_fake(dout, y, row_id_map, probs=None, compute_dprobs=True):
    K, T = row_id_map.shape
    return (y.new_empty(y.shape), y.new_empty((T, K) if compute_dprobs else (0,), dtype=torch.float32))
