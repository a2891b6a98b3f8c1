"""The vision tower's window attention in a few SDPA calls.

Without flash attention, transformers 4.52 and later run ``scaled_dot_product_attention`` once per
window: at Qwen2.5-VL's window size (64 patches), hundreds of calls a layer for a few images, each too
small to fill the GPU and bounded by the host; 4.49-4.51 run one call over every patch under a
block-diagonal mask (work and mask quadratic in the patches). The windows of an image are consecutive in the tower's
order and mostly of one length, so each run of consecutive equal-length windows is one batched call of
the same kernel here (a window attends only within itself, as before)."""

import weakref
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def window_runs(lengths: Sequence[int]) -> List[Tuple[int, int]]:
    """``[(length, count)]``: consecutive windows of one length, in order; empty windows dropped."""
    runs: List[Tuple[int, int]] = []
    for n in lengths:
        if n < 0:
            raise ValueError(f"mmfuse window attention: cu_seqlens: expected non-decreasing offsets, got a window "
                             f"of length {n}")
        if n == 0:
            continue
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


_last = [None, -1, None]  # (weak reference to cu_seqlens, its version, its window lengths)


@torch.compiler.disable  # data-dependent either way; run eagerly, the cache holds under torch.compile too
def window_lengths(cu_seqlens: Tensor) -> List[int]:
    """The window lengths of ``cu_seqlens`` on the host. The tower passes one tensor to each of its
    layers: it is read once (one host sync a forward, where transformers syncs once a layer)."""
    ref, version, lengths = _last
    if ref is not None and ref() is cu_seqlens and version == cu_seqlens._version:
        return lengths
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    _last[:] = [weakref.ref(cu_seqlens), cu_seqlens._version, lengths]
    return lengths


def sdpa_by_windows(q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int], scale: float) -> Tensor:
    """Attention of each window to itself: ``q``, ``k``, ``v`` ``[S, H, D]`` (any strides), ``lengths``
    summing to S; returns ``[S, H, D]``. Each run of consecutive windows of one length is one
    ``scaled_dot_product_attention`` over ``[windows, H, length, D]`` views (no copy in)."""
    S, H, D = q.shape
    if sum(lengths) != S:
        raise ValueError(f"mmfuse window attention: cu_seqlens: expected windows covering the {S} patches, got "
                         f"{sum(lengths)}")
    if S == 0:
        return q.new_empty((0, H, D))
    runs = window_runs(lengths)
    sizes = [n * count for n, count in runs]
    # one split of each input (its backward: one cat), not a slice a run (each slice's backward writes a
    # zero-filled [S, H, D] gradient and adds it up: three full passes a run)
    qs, ks, vs = q.split(sizes), k.split(sizes), v.split(sizes)
    outs = []
    for (n, count), qr, kr, vr in zip(runs, qs, ks, vs):

        def windows(t):
            return t.unflatten(0, (count, n)).transpose(1, 2)

        o = F.scaled_dot_product_attention(windows(qr), windows(kr), windows(vr), scale=scale)
        outs.append(o.transpose(1, 2).reshape(n * count, H, D))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


__all__ = ["sdpa_by_windows", "window_lengths", "window_runs"]
