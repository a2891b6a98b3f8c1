"""Multimodal position preprocessing (SEMANTICS.md sections 3 and 4): ``rope_index``, the 3-D (T, H,
W) position ids of a Qwen2-VL / Qwen2.5-VL batch of text, images and videos; the vision tower's patch
positions (``vision_positions``), its rotary angle table (``rot_pos_emb``) and its window order
(``window_index``). CPU and CUDA kernels; on CUDA no host sync (``rope_index`` is capturable in a
CUDA graph), except the one copy of a device ``grid_thw`` to the host that the vision ops need for
their output sizes (pass the processor's host ``grid_thw`` to avoid it).

Bad input found on the device (a span running past its row, more spans than grids, ...) prints the
problem and stops the kernel with a device-side assertion, as PyTorch's own index checks do; on the
CPU it raises ValueError.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from . import _lib  # noqa: F401  (registers the ops)

Tensor = torch.Tensor
_rope_index = torch.ops.mmfuse.rope_index.default
_window_index = torch.ops.mmfuse.window_index.default


def rope_index(
    input_ids: Tensor,
    image_grid_thw: Optional[Tensor] = None,
    video_grid_thw: Optional[Tensor] = None,
    second_per_grid_ts: Optional[Tensor] = None,
    attention_mask: Optional[Tensor] = None,
    *,
    spatial_merge_size: int = 2,
    image_token_id: int = 151655,
    video_token_id: int = 151656,
    vision_start_token_id: int = 151652,
    tokens_per_second: float = 2.0,
    mode: str = "qwen",
    mm_token_type_ids: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """3-D position ids of a multimodal batch, bit-exact to a transformers release per ``mode``.

    ``mode="qwen"`` (default; transformers 4.49-4.51 and Qwen's own code) and ``"hf4"`` (4.52-4.57):
    each row is compacted to its tokens with ``attention_mask == 1``. A vision start token followed by
    an image (video) token opens a span of ``t * (h/m) * (w/m)`` tokens (m = ``spatial_merge_size``)
    whose grid is the next row of ``image_grid_thw`` (``video_grid_thw``); grids are consumed in order
    across the batch. Text before a span gets ``st + [0, n)`` on all three axes (``st`` = one past the
    largest position so far); a span gets ``(st + n + T, st + n + row, st + n + col)``, t-major, with
    ``T = 0`` for images and, for frame ``i`` of a video with ``sec`` seconds per grid (1.0 when
    ``second_per_grid_ts`` is absent): qwen: ``trunc(fp32(fp32(i * sec) * tokens_per_second))``; hf4:
    ``trunc(i * int(sec) * tokens_per_second)``. Padded slots get 1; ``deltas[b] = max + 1 - L``.

    ``mode="hf5"`` (transformers 5.x, e.g. 5.17; needs ``mm_token_type_ids``, 0 text / 1 image / 2
    video): rows compacted with ``attention_mask != 0``; each run of equal nonzero type is a span (its
    length must be its grid's token count); a span at ``st`` gets ``(st + T, st + row, st + col)`` with
    ``T = i`` for images and ``i * tokens_per_second * int(sec)`` for videos; text after a span resumes
    at ``st + max(h, w) / m``. Padded slots get 0; ``deltas[b] = max + 1 - (valid tokens of row b)``.

    An all-padding row gives the pad value and delta 0 in every mode.

    Args:
        input_ids, attention_mask, mm_token_type_ids: ``[B, L]`` int64 / int32 (the mask may be
            absent: all valid).
        image_grid_thw, video_grid_thw: ``[n, 3]`` int64 / int32 (t, h, w in patches), or None.
        second_per_grid_ts: ``[n_videos]`` float32, or None.
        All tensors on one device.

    Returns:
        ``(position_ids [3, B, L] int64, deltas [B, 1] int64)`` on the device of ``input_ids``.

    Bad input (more spans than grids, a span that runs past its row or whose tokens are not all image
    (video) tokens, h or w not divisible by the merge size, a vision start as the last valid token):
    ValueError on the CPU, a device-side assertion with the message printed on CUDA. Wrong dtypes,
    shapes or devices: ValueError.
    """
    return _rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                       spatial_merge_size, image_token_id, video_token_id, vision_start_token_id,
                       float(tokens_per_second), mode, mm_token_type_ids)


@torch.library.register_fake("mmfuse::rope_index")
def _rope_index_fake(input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                     attention_mask=None, spatial_merge_size=2, image_token_id=151655, video_token_id=151656,
                     vision_start_token_id=151652, tokens_per_second=2.0, mode="qwen", mm_token_type_ids=None):
    B, L = input_ids.shape
    return input_ids.new_empty((3, B, L), dtype=torch.long), input_ids.new_empty((B, 1), dtype=torch.long)


def vision_positions(grid_thw: Tensor, spatial_merge_size: int = 2, *,
                     device: Optional[torch.device] = None) -> Tensor:
    """(row, col) of every patch of the vision tower's input, int64 ``[sum t*h*w, 2]`` (HF 5.x
    ``get_vision_position_ids``): patches in spatial-merge-block order (for each m x m block,
    block-row-major, its patches row-major inside the block), frames repeating the layout.

    ``grid_thw``: ``[n, 3]`` int64 / int32 (t, h, w in patches; h, w divisible by m). Output on
    ``device`` (default: that of ``grid_thw``); a host grid with a CUDA ``device`` is the sync-free way.
    """
    return torch.ops.mmfuse.vision_positions(grid_thw, spatial_merge_size, device)


@torch.library.register_fake("mmfuse::vision_positions")
def _vision_positions_fake(grid_thw, spatial_merge_size=2, device=None):
    n = torch.library.get_ctx().new_dynamic_size()
    return torch.empty((n, 2), dtype=torch.long, device=device if device is not None else grid_thw.device)


def rot_pos_emb(inv_freq: Tensor, grid_thw: Tensor, spatial_merge_size: int = 2) -> Tensor:
    """The vision RoPE angle table (HF ``rot_pos_emb``): fp32 ``[sum t*h*w, 2F]``, patch ``n`` at
    (row, col) (see :func:`vision_positions`) giving ``[row * inv_freq | col * inv_freq]``, one fp32
    multiply each (bit-exact to HF). ``inv_freq``: fp32 ``[F]`` (F = head_dim / 4); the output is on its
    device. Feed it to :func:`mmfuse.vision_rope` as ``freqs``.
    """
    return torch.ops.mmfuse.rot_pos_emb(inv_freq, grid_thw, spatial_merge_size)


@torch.library.register_fake("mmfuse::rot_pos_emb")
def _rot_pos_emb_fake(inv_freq, grid_thw, spatial_merge_size=2):
    n = torch.library.get_ctx().new_dynamic_size()
    return inv_freq.new_empty((n, 2 * inv_freq.shape[0]), dtype=torch.float32)


class WindowIndex(NamedTuple):
    """The vision tower's window order (see :func:`window_index`)."""
    window_index: Tensor       # int64 [tokens]: merged-token indices in window order
    cu_window_seqlens: Tensor  # int32 [windows + 1]: running patch count of the windows
    reverse_index: Tensor      # int64 [tokens]: the inverse permutation (HF's argsort(window_index))
    cu_seqlens: Tensor         # int32 [frames + 1]: running patch count of the frames (full attention)
    max_seqlen: int            # max h*w: for the full-attention blocks
    max_window_seqlen: int     # the largest window, in patches


def window_index(grid_thw: Tensor, spatial_merge_size: int = 2, window_size: int = 112, patch_size: int = 14, *,
                 device: Optional[torch.device] = None) -> WindowIndex:
    """Window order of the Qwen2.5-VL vision tower's window attention (HF ``get_window_index``), with
    everything its attention needs.

    Per grid ``(t, h, w)`` (patches), the merged grid ``h/m x w/m`` is tiled in ``ws x ws`` windows,
    ``ws = window_size // m // patch_size`` (4 for Qwen2.5-VL), the last row / column partial;
    windows are listed frame by frame, window-row-major; inside a window, merged tokens row-major.

    Args:
        grid_thw: ``[n, 3]`` int64 / int32, h and w divisible by m. The output sizes are computed from
            a host copy: pass the processor's host tensor (no sync; outputs on ``device``, default the
            grid's), or a device tensor (one copy to the host).

    Returns:
        :class:`WindowIndex`: ``window_index`` (grids offset by their running token count),
        ``cu_window_seqlens`` (from 0, no zero-length window: equal to HF after its
        ``unique_consecutive``), ``reverse_index`` (a scatter, not a sort), ``cu_seqlens`` (per frame,
        as HF's ``get_vision_cu_seqlens``), and the host ints ``max_seqlen`` and ``max_window_seqlen``.
    """
    host = grid_thw if grid_thw.device.type == "cpu" else grid_thw.cpu()
    dev = device if device is not None else grid_thw.device
    idx, cu, rev, cus = _window_index(host, spatial_merge_size, window_size, patch_size, dev)
    m, ws = spatial_merge_size, window_size // spatial_merge_size // patch_size
    h, w = host[:, 1].long(), host[:, 2].long()
    max_seqlen = int((h * w).max()) if host.shape[0] else 0
    max_window = int(((h // m).clamp(max=ws) * (w // m).clamp(max=ws)).max()) * m * m if host.shape[0] else 0
    return WindowIndex(idx, cu, rev, cus, max_seqlen, max_window)


@torch.library.register_fake("mmfuse::window_index")
def _window_index_fake(grid_thw, spatial_merge_size=2, window_size=112, patch_size=14, device=None):
    ctx = torch.library.get_ctx()
    dev = device if device is not None else grid_thw.device
    tokens, windows, frames = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (torch.empty((tokens,), dtype=torch.long, device=dev), torch.empty((windows,), dtype=torch.int32, device=dev),
            torch.empty((tokens,), dtype=torch.long, device=dev), torch.empty((frames,), dtype=torch.int32, device=dev))
