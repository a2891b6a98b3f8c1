"""Multimodal position preprocessing: ``rope_index``, the 3-D (T, H, W) position ids of a Qwen2-VL /
Qwen2.5-VL batch of text, images and videos (SEMANTICS.md section 3). CPU for now; the CUDA backend
(one parallel pass per row, no host sync), vision positions and the window index follow (issue 3).
"""

from typing import Optional, Tuple

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
) -> Tuple[Tensor, Tensor]:
    """3-D position ids of a multimodal batch, bit-exact to a transformers release per ``mode``.

    Each row is compacted to its tokens with ``attention_mask == 1``. A vision start token followed by
    an image (video) token opens a span of ``t * (h/m) * (w/m)`` tokens (m = ``spatial_merge_size``)
    whose grid is the next row of ``image_grid_thw`` (``video_grid_thw``); grids are consumed in order
    across the batch. Text before a span gets ``st + [0, n)`` on all three axes (``st`` = one past the
    largest position so far); a span gets ``(st + n + T, st + n + row, st + n + col)``, t-major, with
    ``T = 0`` for images and, for frame ``i`` of a video with ``sec`` seconds per grid (1.0 when
    ``second_per_grid_ts`` is absent): ``mode="qwen"`` (transformers 4.49-4.51, Qwen's own code):
    ``trunc(fp32(fp32(i * sec) * tokens_per_second))``; ``mode="hf4"`` (4.52-4.57):
    ``trunc(i * int(sec) * tokens_per_second)``. Padded slots get 1; ``deltas[b] = max + 1 - L``; an
    all-padding row gives 1s and delta 0.

    Args:
        input_ids, attention_mask: ``[B, L]`` int64 / int32 (the mask may be absent: all valid).
        image_grid_thw, video_grid_thw: ``[n, 3]`` int64 / int32 (t, h, w in patches), or None.
        second_per_grid_ts: ``[n_videos]`` float32, or None.

    Returns:
        ``(position_ids [3, B, L] int64, deltas [B, 1] int64)``.

    Raises ValueError on bad input: more spans than grids, a span that runs past its row or whose
    tokens are not all image (video) tokens, h or w not divisible by the merge size, a vision start as
    the last valid token, wrong dtypes, shapes or devices.
    """
    return _rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                       spatial_merge_size, image_token_id, video_token_id, vision_start_token_id,
                       float(tokens_per_second), mode)


@torch.library.register_fake("mmfuse::rope_index")
def _rope_index_fake(input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                     attention_mask=None, spatial_merge_size=2, image_token_id=151655, video_token_id=151656,
                     vision_start_token_id=151652, tokens_per_second=2.0, mode="qwen"):
    B, L = input_ids.shape
    return input_ids.new_empty((3, B, L), dtype=torch.long), input_ids.new_empty((B, 1), dtype=torch.long)


def window_index(grid_thw: Tensor, spatial_merge_size: int = 2, window_size: int = 112,
                 patch_size: int = 14) -> Tuple[Tensor, Tensor]:
    """Window order of the Qwen2.5-VL vision tower's window attention (HF ``get_window_index``).

    Per grid ``(t, h, w)`` (patches), the merged grid ``h/m x w/m`` is tiled in ``ws x ws`` windows,
    ``ws = window_size // m // patch_size`` (4 for Qwen2.5-VL), the last row / column partial;
    windows are listed frame by frame, window-row-major; inside a window, merged tokens row-major.

    Args:
        grid_thw: ``[n, 3]`` int64 / int32 on the CPU, as the processor produces it (the output
            sizes are computed from it on the host; no device sync). h and w divisible by m.

    Returns:
        ``(window_index [sum t*(h/m)*(w/m)] int64, cu_window_seqlens [windows + 1] int32)``: merged-token
        indices (grids offset by their running token count) in window order, and the running patch
        count of the windows, from 0, with no zero-length window (equal to HF after its
        ``unique_consecutive``). CPU tensors for now (CUDA outputs to follow).
    """
    return _window_index(grid_thw, spatial_merge_size, window_size, patch_size)


@torch.library.register_fake("mmfuse::window_index")
def _window_index_fake(grid_thw, spatial_merge_size=2, window_size=112, patch_size=14):
    ctx = torch.library.get_ctx()
    return grid_thw.new_empty((ctx.new_dynamic_size(),), dtype=torch.long), \
        grid_thw.new_empty((ctx.new_dynamic_size(),), dtype=torch.int32)
