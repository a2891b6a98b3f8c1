"""A scoped, reversible patch of the installed transformers' Qwen2.5-VL model (transformers 5.x, e.g.
5.17) that computes with mmfuse:

- the 3-D text position ids: ``Qwen2_5_VLModel.get_rope_index`` -> :func:`mmfuse.rope_index` in mode
  ``"hf5"`` (bit-exact to transformers 5.x, on the device, no host sync);
- the vision tower's patch positions, window index, ``cu_seqlens`` / ``cu_window_seqlens`` and their
  maxima -> :func:`mmfuse.vision_positions` and :func:`mmfuse.window_index`, through the model's
  precomputed-kwargs hooks (``get_vision_position_ids``, ``get_vision_attention_seqlens``,
  ``get_vision_window_index`` take precomputed values from ``kwargs``; the patch fills them);
- the text RoPE (``apply_rotary_pos_emb``, plain tables already in mRoPE layout) -> :func:`mmfuse.mrope`
  with ``numerics="hf_eager"`` (bitwise equal to transformers' formula, forward and backward);
- the vision RoPE (``apply_rotary_pos_emb_vision``, fp32 tables) -> :func:`mmfuse.mrope` with
  ``numerics="fp32"`` (bitwise equal forward);
- with ``rms_norm=True``: every ``Qwen2_5_VLRMSNorm`` (text and vision) -> :func:`mmfuse.rms_norm`
  (HF's roundings; the mean square summed in another order, so close rather than bitwise); where the
  weight's dtype is not the input's, transformers' own;
- with ``swiglu=True``: the text and vision MLPs (``Qwen2MLP``, ``Qwen2_5_VLMLP``) -> one GEMM against
  the stacked gate/up weight, :func:`mmfuse.swiglu` (fp32 math, one rounding: close to HF's two bf16
  roundings), then the down projection; an MLP whose activation is not SiLU stays transformers' own.

Usage::

    from mmfuse.integrations.transformers import patch_qwen2_5_vl
    with patch_qwen2_5_vl():
        out = model(**batch)          # inside: mmfuse; outside: transformers as installed

or ``patch = patch_qwen2_5_vl(); patch.apply(); ...; patch.revert()``. The patch changes functions of
the ``modeling_qwen2_5_vl`` module and one method of ``Qwen2_5_VLModel``: it affects every model of
that class while active. What stays transformers' own: the vision tower's ``argsort`` of the window
index and the cos/sin tables (computed by its rotary modules).
"""

import inspect

import torch
import torch.nn.functional as F

from .. import positions as _positions
from .. import rope as _rope
from ..rms_norm import rms_norm as _rms_norm
from ..swiglu import swiglu as _swiglu


def _modeling():
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    except ImportError as e:
        raise ImportError("mmfuse.integrations.transformers needs transformers (5.x) installed") from e
    needed = ("get_vision_position_ids", "get_vision_attention_seqlens", "get_vision_window_index",
              "apply_rotary_pos_emb", "apply_rotary_pos_emb_vision")
    missing = [n for n in needed if not hasattr(m, n)]
    if missing or "mm_token_type_ids" not in inspect.signature(m.Qwen2_5_VLModel.get_rope_index).parameters:
        raise ImportError(f"mmfuse.integrations.transformers: this transformers' Qwen2.5-VL is not the 5.x layout "
                          f"it patches (missing: {missing or ['get_rope_index(mm_token_type_ids)']})")
    return m


class patch_qwen2_5_vl:
    """Scoped patch (a context manager, or ``apply()`` / ``revert()``); see the module docstring."""

    def __init__(self, positions: bool = True, rope: bool = True, rms_norm: bool = False, swiglu: bool = False):
        self.positions, self.rope, self.rms_norm, self.swiglu = positions, rope, rms_norm, swiglu
        self._saved = []

    # ---- replacements ----
    @staticmethod
    def _make(m):
        orig_pos, orig_seq, orig_win = m.get_vision_position_ids, m.get_vision_attention_seqlens, \
            m.get_vision_window_index
        from transformers.utils.generic import is_flash_attention_requested

        def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                           second_per_grid_ts=None, attention_mask=None, **kwargs):
            vc = self.config.vision_config
            return _positions.rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                         attention_mask, spatial_merge_size=vc.spatial_merge_size,
                                         tokens_per_second=float(vc.tokens_per_second), mode="hf5",
                                         mm_token_type_ids=mm_token_type_ids)

        def get_vision_position_ids(grid_thw, spatial_merge_size, include_temporal=False, kwargs=None):
            if (kwargs is not None and kwargs.get("position_ids") is not None) or include_temporal or \
                    not isinstance(spatial_merge_size, int):
                return orig_pos(grid_thw, spatial_merge_size, include_temporal=include_temporal, kwargs=kwargs)
            return _positions.vision_positions(grid_thw, spatial_merge_size)

        def get_vision_attention_seqlens(grid_thw, config, merge_temporal=False, kwargs=None):
            # one mmfuse.window_index gives cu_seqlens and, for the window blocks that follow, the window
            # index, cu_window_seqlens and max_window_seqlen (left in kwargs for get_vision_window_index)
            if merge_temporal or kwargs is None or kwargs.get("cu_seqlens") is not None or \
                    not hasattr(config, "window_size"):
                return orig_seq(grid_thw, config, merge_temporal=merge_temporal, kwargs=kwargs)
            w = _positions.window_index(grid_thw, config.spatial_merge_size, config.window_size, config.patch_size)
            flash = is_flash_attention_requested(config)
            if kwargs.get("window_index") is None and kwargs.get("cu_window_seqlens") is None:
                kwargs["window_index"], kwargs["cu_window_seqlens"] = w.window_index, w.cu_window_seqlens
                if flash and kwargs.get("max_window_seqlen") is None:
                    kwargs["max_window_seqlen"] = w.max_window_seqlen
            max_seqlen = kwargs.pop("max_seqlen", None)
            if max_seqlen is None and flash:
                max_seqlen = w.max_seqlen
            return w.cu_seqlens, max_seqlen

        def get_vision_window_index(grid_thw, spatial_merge_size, window_size, patch_size, kwargs=None):
            if kwargs is not None and kwargs.get("window_index") is not None and \
                    kwargs.get("cu_window_seqlens") is not None:
                return orig_win(grid_thw, spatial_merge_size, window_size, patch_size, kwargs=kwargs)
            w = _positions.window_index(grid_thw, spatial_merge_size, window_size, patch_size)
            return w.window_index, w.cu_window_seqlens

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if unsqueeze_dim != 1 or cos.dim() != 3:
                raise ValueError("mmfuse patch: apply_rotary_pos_emb: expected [B, H, L, D] q/k and [B, L, D] tables")
            return _rope.mrope(q, k, cos, sin, numerics="hf_eager")  # [B, H, L, D] (bhld)

        def apply_rotary_pos_emb_vision(q, k, cos, sin):
            # q, k [N, H, D]; cos, sin [N, D]: plain RoPE with fp32 tables, fp32 math, one rounding
            qo, ko = _rope.mrope(q[None], k[None], cos[None].float(), sin[None].float(), numerics="fp32",
                                 qk_layout="blhd")
            return qo[0], ko[0]

        orig_norm = m.Qwen2_5_VLRMSNorm.forward
        orig_text_mlp, orig_vision_mlp = m.Qwen2MLP.forward, m.Qwen2_5_VLMLP.forward

        def norm_forward(self, hidden_states):
            if self.weight.dtype != hidden_states.dtype:
                return orig_norm(self, hidden_states)
            return _rms_norm(hidden_states, self.weight, self.variance_epsilon)

        def mlp(orig):
            def forward(self, x):
                act = self.act_fn
                if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
                    return orig(self, x)
                g, u = self.gate_proj, self.up_proj
                bias = None if g.bias is None else torch.cat([g.bias, u.bias])
                gate_up = F.linear(x, torch.cat([g.weight, u.weight]), bias)
                return self.down_proj(_swiglu(gate_up))
            return forward

        return dict(get_rope_index=get_rope_index, get_vision_position_ids=get_vision_position_ids,
                    get_vision_attention_seqlens=get_vision_attention_seqlens,
                    get_vision_window_index=get_vision_window_index, apply_rotary_pos_emb=apply_rotary_pos_emb,
                    apply_rotary_pos_emb_vision=apply_rotary_pos_emb_vision, norm_forward=norm_forward,
                    text_mlp_forward=mlp(orig_text_mlp), vision_mlp_forward=mlp(orig_vision_mlp))

    def apply(self):
        if self._saved:
            raise RuntimeError("mmfuse patch_qwen2_5_vl: already applied")
        m = _modeling()
        new = self._make(m)
        targets = []
        if self.positions:
            targets += [(m.Qwen2_5_VLModel, "get_rope_index"), (m, "get_vision_position_ids"),
                        (m, "get_vision_attention_seqlens"), (m, "get_vision_window_index")]
        if self.rope:
            targets += [(m, "apply_rotary_pos_emb"), (m, "apply_rotary_pos_emb_vision")]
        renamed = []  # (owner, attribute, key in `new`)
        if self.rms_norm:
            renamed.append((m.Qwen2_5_VLRMSNorm, "forward", "norm_forward"))
        if self.swiglu:
            renamed += [(m.Qwen2MLP, "forward", "text_mlp_forward"), (m.Qwen2_5_VLMLP, "forward", "vision_mlp_forward")]
        for owner, name in targets:
            self._saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, new[name])
        for owner, name, key in renamed:
            self._saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, new[key])
        return self

    def revert(self):
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def __enter__(self):
        return self.apply()

    def __exit__(self, *exc):
        self.revert()
        return False


__all__ = ["patch_qwen2_5_vl"]
