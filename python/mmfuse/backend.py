"""Seed-compatible entry points (the ``wallx_csrc``-style backend), with the corrected semantics of
``SEMANTICS.md``. New code should call :mod:`mmfuse` directly.
"""

from typing import Optional, Sequence, Union

import torch

from . import _lib  # noqa: F401
from .dual_gemm import _mn as _gemm_mn, dual_gemm as _dual_gemm, dual_gemm_out as _dual_gemm_out
from . import moe as _moe
from . import positions as _positions

Tensor = torch.Tensor

# The seed's 1.0.1 kernel hard-coded Qwen2.5-VL's doubled sections for head dim 128.
_SEED_DOUBLED_DEFAULT = (32, 48, 48)


def _seed_section(mrope_section_doubled: Union[bool, Sequence[int], None], head_dim: int):
    """Doubled sections ``[2*s_t, 2*s_h, 2*s_w]`` (or True for Qwen2.5-VL's, False/None for plain)."""
    if mrope_section_doubled is None or mrope_section_doubled is False:
        return ()
    if mrope_section_doubled is True:
        if head_dim != 128:
            raise ValueError(
                f"mmfuse.backend.rope: mrope_section_doubled=True means Qwen2.5-VL's [32, 48, 48] for head dim 128, "
                f"got head dim {head_dim}; pass the doubled sections explicitly")
        mrope_section_doubled = _SEED_DOUBLED_DEFAULT
    doubled = [int(s) for s in mrope_section_doubled]
    if len(doubled) != 3 or any(s % 2 for s in doubled):
        raise ValueError(f"mmfuse.backend.rope: mrope_section_doubled: expected 3 even entries, got {doubled}")
    return [s // 2 for s in doubled]


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _apply(x_q, x_k, cos, sin, out_q, out_k, mrope_section_doubled, backward: bool) -> None:
    section = _seed_section(mrope_section_doubled, x_q.shape[-1])
    heads_first = x_q.dim() == 4  # the seed's [B, H, L, D]
    if _same(x_q, out_q) and _same(x_k, out_k):
        torch.ops.mmfuse.mrope_(x_q, x_k, cos, sin, None, None, section, False, "fp32", backward, heads_first)
    else:
        torch.ops.mmfuse.mrope_out(x_q, x_k, cos, sin, None, None, section, False, "fp32", backward, heads_first,
                                   out_q, out_k)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_out: Tensor,
         mrope_section_doubled) -> None:
    """Seed ``rope``: writes RoPE / mRoPE of ``q``, ``k`` (``[B, H, L, D]``) into ``q_out``, ``k_out``.

    ``cos``/``sin`` are HF tables ``[3, B, L, D]`` (or ``[B, L, D]`` for plain RoPE).
    ``mrope_section_doubled`` is HF's ``[2*s_t, 2*s_h, 2*s_w]`` (e.g. ``[32, 48, 48]``), ``True`` for
    exactly that at head dim 128, or ``False`` for plain RoPE; the correct rule applies (channel ``j`` and
    ``j + D/2`` share one angle, unlike the seed's kernel). Outputs may be the inputs themselves (in
    place) or separate tensors; numerics are ``"fp32"`` (:func:`mmfuse.mrope`).
    """
    _apply(q, k, cos, sin, q_out, k_out, mrope_section_doubled, backward=False)


def rope_bwd(grad_q_out: Tensor, grad_k_out: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
             grad_q: Tensor, grad_k: Tensor, mrope_section_doubled) -> None:
    """Seed ``rope_bwd``: writes the gradients w.r.t. q and k into ``grad_q``, ``grad_k``.

    ``q`` and ``k`` are accepted for signature compatibility and not read (the backward of a rotation
    needs only the angles). ``grad_q`` may alias ``grad_q_out`` (in place).
    """
    del q, k
    _apply(grad_q_out, grad_k_out, cos, sin, grad_q, grad_k, mrope_section_doubled, backward=True)


def get_rope_index(input_ids: Tensor, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                   spatial_merge_size: int, image_token_id: int, video_token_id: int, vision_start_token_id: int,
                   tokens_per_second: float):
    """Seed ``get_rope_index``: :func:`mmfuse.rope_index` in mode ``"qwen"`` (the Qwen team's and
    transformers 4.49-4.51's results) with the seed's positional signature. Exact integer math (the
    seed's float-reciprocal division, padding shift and 64-span cap are gone); returns
    ``(position_ids [3, B, L] int64, deltas [B, 1] int64)``."""
    return _positions.rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                             spatial_merge_size=spatial_merge_size, image_token_id=image_token_id,
                             video_token_id=video_token_id, vision_start_token_id=vision_start_token_id,
                             tokens_per_second=tokens_per_second, mode="qwen")


def rot_pos_emb(inv_freq: Tensor, grid_thw: Tensor, spatial_merge_size: int) -> Tensor:
    """Seed ``rot_pos_emb``: :func:`mmfuse.rot_pos_emb` (fp32 ``[sum t*h*w, 2 * len(inv_freq)]``)."""
    return _positions.rot_pos_emb(inv_freq, grid_thw, spatial_merge_size)


def get_window_index(grid_thw: Tensor, spatial_merge_size: int, vit_merger_window_size: int, patch_size: int,
                     spatial_merge_unit: int):
    """Seed ``get_window_index``: ``(window_index int64, cu_window_seqlens int32)`` of
    :func:`mmfuse.window_index`, with ``vit_merger_window_size`` the window side in merged tokens (4 for
    Qwen2.5-VL) and ``spatial_merge_unit`` checked to be ``spatial_merge_size ** 2``. A device
    ``grid_thw`` costs one copy to the host (the output sizes); the outputs are on its device."""
    if spatial_merge_unit != spatial_merge_size ** 2:
        raise ValueError(f"mmfuse.backend.get_window_index: spatial_merge_unit: expected spatial_merge_size ** 2 = "
                         f"{spatial_merge_size ** 2}, got {spatial_merge_unit}")
    w = _positions.window_index(grid_thw, spatial_merge_size, vit_merger_window_size * spatial_merge_size * patch_size,
                            patch_size)
    return w.window_index, w.cu_window_seqlens


def permute(input: Tensor, indices: Tensor, num_out_tokens: int, workspace, max_expanded_token_num: int):
    """Seed ``permute``: returns ``(permuted, row_id_map, workspace)`` as the seed's kernel did, with the
    corrected semantics of :func:`mmfuse.moe_permute` (the same stable order, no default stream, no
    process-global cache). ``workspace`` is accepted and returned unchanged (mmfuse takes its scratch
    from PyTorch's caching allocator, per call, on the current stream); ``max_expanded_token_num`` is
    ignored (sizes come from ``indices``); ``num_out_tokens`` 0 keeps all.
    The seed's signature has no expert count: the order comes from ``moe_sort_plan`` (a radix sort of
    the ids on the GPU), not from ``indices.max() + 1``, which would cost a host sync. Ids may be any
    value in ``[0, 2^31)``; a negative one is an error naming it."""
    del max_expanded_token_num
    if indices.device != input.device:
        raise ValueError(f"mmfuse.backend.permute: indices: expected a tensor on {input.device} (that of input), "
                         f"got {indices.device}")
    row_id_map = torch.ops.mmfuse.moe_sort_plan(indices, num_out_tokens)
    rows = torch.ops.mmfuse.moe_permute(input, row_id_map, num_out_tokens or indices.numel())
    return rows, row_id_map, workspace


def _seed_map(row_id_map: Tensor, num_tokens: int, topk: int) -> Tensor:
    if row_id_map.dim() == 1:  # the seed's flat [K * T]
        if row_id_map.numel() != num_tokens * topk:
            raise ValueError(f"mmfuse.backend: row_id_map: expected {topk} x {num_tokens} entries, got "
                             f"{row_id_map.numel()}")
        return row_id_map.view(topk, num_tokens)
    return row_id_map


def unpermute(input: Tensor, row_id_map: Tensor, prob: Tensor, max_tokens: int, num_topK: int) -> Tensor:
    """Seed ``unpermute``: :func:`mmfuse.moe_unpermute` (fp32 accumulation; an empty ``prob`` means weights
    1, for every K including 1). ``row_id_map`` may be the seed's flat ``[K * T]``."""
    probs = prob if prob is not None and prob.numel() else None
    return _moe.moe_unpermute(input, _seed_map(row_id_map, max_tokens, num_topK), probs)


def unpermute_bwd(input_bwd: Tensor, input_fwd: Tensor, row_id_map: Tensor, prob: Optional[Tensor]):
    """Seed ``unpermute_bwd``: ``(grad_input, grad_prob)``; ``grad_prob`` is defined for K = 1 too and is
    0 for dropped entries; ``prob`` None or empty means weights 1."""
    T = input_bwd.shape[0]
    K = row_id_map.numel() // max(T, 1) if row_id_map.dim() == 1 else row_id_map.shape[0]
    probs = prob if prob is not None and prob.numel() else None
    return torch.ops.mmfuse.moe_unpermute_backward(input_bwd, input_fwd, _seed_map(row_id_map, T, K), probs)


def asym_dual_gmm_separated(input_expert0: Tensor, input_expert1: Tensor, weight_expert0: Tensor,
                            weight_expert1: Tensor, output_expert0: Optional[Tensor] = None,
                            output_expert1: Optional[Tensor] = None, trans_a: bool = False,
                            trans_b: bool = False):
    """Seed ``asym_dual_gmm_separated``: ``(out0, out1)`` with ``out_e = op(input_e) @ op(weight_e)``.
    Given outputs are written in place and must be contiguous, in the inputs' dtype or float32
    (ValueError otherwise: the seed silently wrote a temporary copy); missing ones are allocated in the
    inputs' dtype. Differentiable when both outputs are allocated here."""
    if output_expert0 is None and output_expert1 is None:
        return _dual_gemm(input_expert0, weight_expert0, input_expert1, weight_expert1, trans_a, trans_b)
    if output_expert0 is None or output_expert1 is None:
        def new(a, w):
            return a.new_empty(_gemm_mn(a, w, trans_a, trans_b))

        output_expert0 = new(input_expert0, weight_expert0) if output_expert0 is None else output_expert0
        output_expert1 = new(input_expert1, weight_expert1) if output_expert1 is None else output_expert1
    _dual_gemm_out(input_expert0, weight_expert0, input_expert1, weight_expert1, output_expert0, output_expert1,
                   trans_a, trans_b)
    return output_expert0, output_expert1
