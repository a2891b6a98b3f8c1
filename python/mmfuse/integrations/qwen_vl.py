"""What :class:`mmfuse.integrations.transformers.patch_qwen2_5_vl` (and ``patch_qwen2_vl``) replaces in the
installed transformers' Qwen2.5-VL (Qwen2-VL), found by the module's layout, which changed several times
(the table names Qwen2.5-VL's classes; Qwen2-VL has the same pieces but the vision windows and the
vision SwiGLU MLP, its videos' time index the frame number):

==================  =====================================  ===========================================
piece               where it lives                         mmfuse
==================  =====================================  ===========================================
text positions      ``get_rope_index`` of the model         :func:`mmfuse.rope_index`, the mode of the
                    (4.49-4.51: of the ``For...``          release: ``qwen`` (4.49-4.51), ``hf4``
                    class)                                 (4.52-5.2; 5.2 pads with 0), ``hf5`` (5.8+)
vision positions    methods ``rot_pos_emb`` /              :func:`mmfuse.rot_pos_emb`,
                    ``get_window_index`` (up to 5.8), or   :func:`mmfuse.vision_positions`,
                    the ``vision_utils`` hooks (5.10+)     :func:`mmfuse.window_index`
text RoPE           ``apply_multimodal_rotary_pos_emb``    :func:`mmfuse.mrope` (``hf_eager``)
                    (3-plane tables) or
                    ``apply_rotary_pos_emb`` (5.17+)
vision RoPE         ``apply_rotary_pos_emb_vision``        :func:`mmfuse.mrope` (``fp32``)
RMSNorm             ``Qwen2_5_VLRMSNorm`` (5.2+) or        :func:`mmfuse.rms_norm`
                    ``Qwen2RMSNorm``
MLPs                ``Qwen2MLP``, ``Qwen2_5_VLMLP``        stacked gate/up GEMM, :func:`mmfuse.swiglu`
vision attention    ``Qwen2_5_VLVisionAttention.forward``  SDPA a run of equal windows
                    (4.52+, with SDPA: one call a window)  (:mod:`mmfuse.integrations.window_attention`)
                    ``Qwen2_5_VLVisionSdpaAttention``
                    (4.49-4.51: one call, every patch,
                    under a block-diagonal mask)
loss                ``Qwen2_5_VLForConditionalGeneration   :func:`mmfuse.linear_cross_entropy`
                    .forward``
==================  =====================================  ===========================================

Each ``*_targets(spec, m, v)`` function returns ``[(owner, attribute, replacement)]`` for one piece, or
raises ImportError naming the piece and the version when the layout is not one of these.
"""

import inspect
import re
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .. import positions as _positions
from .. import rope as _rope
from ..rms_norm import rms_norm as _rms_norm
from ..swiglu import swiglu as _swiglu
from . import window_attention as _windows
from .causal_lm_loss import wrap_forward

SUPPORTED = "transformers 4.49-4.57 and 5.0-5.2, 5.8 and later 5.x"


@dataclass(frozen=True)
class Spec:
    """A model family's names in transformers."""
    name: str                  # for messages
    module: str                # transformers.models.<module>
    model: str                 # the model class (get_rope_index from 4.52)
    for_cg: str                # the *ForConditionalGeneration class
    vision: str                # the vision tower class
    norms: Tuple[str, ...]     # RMSNorm class names, the first present is patched
    mlps: Tuple[str, ...]      # SwiGLU MLP classes
    tokens_per_second: Optional[float]  # None: the vision config's; Qwen2-VL: 1 (time = frame index)
    vision_attention: Tuple[str, ...] = ()  # the vision tower's attention classes (the SDPA ones)


QWEN2_5_VL = Spec("Qwen2.5-VL", "qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel",
                  "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VisionTransformerPretrainedModel",
                  ("Qwen2_5_VLRMSNorm", "Qwen2RMSNorm"), ("Qwen2MLP", "Qwen2_5_VLMLP"), None,
                  ("Qwen2_5_VLVisionAttention", "Qwen2_5_VLVisionSdpaAttention"))
# Qwen3-VL (transformers 4.57+): its text RoPE, norms, MLPs and loss; its positions (timestamps between
# video frames) are not covered
QWEN3_VL = Spec("Qwen3-VL", "qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel", "Qwen3VLForConditionalGeneration",
                "Qwen3VLVisionModel", ("Qwen3VLTextRMSNorm",), ("Qwen3VLTextMLP",), None)
QWEN2_VL = Spec("Qwen2-VL", "qwen2_vl.modeling_qwen2_vl", "Qwen2VLModel", "Qwen2VLForConditionalGeneration",
                "Qwen2VisionTransformerPretrainedModel", ("Qwen2VLRMSNorm", "Qwen2RMSNorm"), ("Qwen2MLP",), 1.0,
                ("VisionAttention", "VisionSdpaAttention"))


def version_tuple(v: str):
    """'4.57.1' -> (4, 57, 1); pre-release and local suffixes dropped."""
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def modeling(spec: Spec = QWEN2_5_VL):
    """(the installed modeling module of the spec's family, transformers' version tuple)."""
    import importlib
    try:
        import transformers
        m = importlib.import_module(f"transformers.models.{spec.module}")
    except ImportError as e:
        raise ImportError(f"mmfuse.integrations.transformers needs transformers ({SUPPORTED}) with {spec.name}") from e
    v = version_tuple(transformers.__version__)
    if v < (4, 49):
        raise ImportError(f"mmfuse.integrations.transformers: transformers {transformers.__version__} has no "
                          f"{spec.name} layout mmfuse patches: supported are {SUPPORTED}")
    return m, v


def _binder(fn):
    """A function giving the arguments of a call of ``fn`` by name, defaults filled in."""
    sig = inspect.signature(fn)

    def bind(*args, **kwargs):
        b = sig.bind(*args, **kwargs)
        b.apply_defaults()
        return b.arguments
    return bind


def _unknown(spec, piece, v):
    return ImportError(f"mmfuse patch: the {piece} of transformers {'.'.join(map(str, v))}'s {spec.name} "
                       f"are not a layout mmfuse knows (supported: {SUPPORTED}); pass {piece.split()[0]}=False to "
                       f"leave them to transformers")


# ---- positions ----------------------------------------------------------------------------------

def rope_index_owner(spec, m):
    """The class whose get_rope_index the model calls (the model from 4.52, before that the For... class)."""
    model = getattr(m, spec.model)
    return model if "get_rope_index" in vars(model) else getattr(m, spec.for_cg)


def text_positions_targets(spec, m, v):
    owner = rope_index_owner(spec, m)
    orig = vars(owner).get("get_rope_index")
    if orig is None:
        raise _unknown(spec, "positions (get_rope_index)", v)
    params = inspect.signature(orig).parameters
    pad_zero = False
    if "mm_token_type_ids" in params:
        if v < (5, 8):  # 5.3-5.7 read second_per_grid_ts for images too: a video after an image gets another's
            raise ImportError(f"mmfuse patch ({spec.name}): positions: transformers {'.'.join(map(str, v))}'s "
                              f"get_rope_index (5.3-5.7) takes a video's seconds per grid for each image; mmfuse's "
                              f"hf5 mode is 5.8 and later: upgrade, or pass positions=False")
        mode = "hf5"
    elif owner is getattr(m, spec.for_cg):
        mode = "qwen"
    else:
        mode, pad_zero = "hf4", v >= (5, 2)
    clamp_deltas = pad_zero and spec.name == "Qwen2-VL"  # 5.2's Qwen2-VL floors the deltas at 0
    bind = _binder(orig)

    def get_rope_index(self, *args, **kwargs):
        a = bind(self, *args, **kwargs)
        ids = a.get("input_ids")
        if ids is None:
            return orig(self, *args, **kwargs)
        cfg, vc = self.config, self.config.vision_config
        mask = a.get("attention_mask")
        pos, deltas = _positions.rope_index(
            ids, a.get("image_grid_thw"), a.get("video_grid_thw"), a.get("second_per_grid_ts"), mask,
            spatial_merge_size=vc.spatial_merge_size, image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id, vision_start_token_id=cfg.vision_start_token_id,
            tokens_per_second=float(spec.tokens_per_second or getattr(vc, "tokens_per_second", 2.0)), mode=mode,
            mm_token_type_ids=a.get("mm_token_type_ids"))
        if pad_zero and mask is not None:  # 5.2 starts from zeros where 4.52-5.1 start from ones
            pos = pos.masked_fill(mask[None] == 0, 0)
        if clamp_deltas:
            deltas = deltas.clamp_min(0)
        return pos, deltas

    return [(owner, "get_rope_index", get_rope_index)]


def vision_positions_targets(spec, m, v):
    if hasattr(m, "get_vision_position_ids"):
        return _vision_hooks(spec, m, v)
    vm = getattr(m, spec.vision)
    if "rot_pos_emb" not in vars(vm):
        raise _unknown(spec, "positions (vision tower)", v)
    orig_rot = vars(vm)["rot_pos_emb"]

    def rot_pos_emb(self, grid_thw):
        inv_freq = self.rotary_pos_emb.inv_freq
        if inv_freq.dtype != torch.float32:  # a model cast whole to bf16 computes its table in bf16
            return orig_rot(self, grid_thw)
        return _positions.rot_pos_emb(inv_freq, grid_thw, self.spatial_merge_size)

    def get_window_index(self, grid_thw):
        w = _positions.window_index(grid_thw, self.spatial_merge_size, self.window_size, self.patch_size)
        return w.window_index, w.cu_window_seqlens.tolist()  # a list, as the forward expects

    targets = [(vm, "rot_pos_emb", rot_pos_emb)]
    if "get_window_index" in vars(vm):  # Qwen2.5-VL's windows
        targets.append((vm, "get_window_index", get_window_index))
    return targets


def _vision_hooks(spec, m, v):
    """transformers' precomputed-kwargs hooks (5.10+): each computes its value unless ``kwargs`` holds
    it; ours compute with mmfuse, one :func:`mmfuse.window_index` leaving the window order in ``kwargs``
    for the window hook that follows."""
    from transformers.utils import generic as _generic
    flash_requested = getattr(_generic, "is_flash_attention_requested", None)
    orig_pos = m.get_vision_position_ids
    bind_pos = _binder(orig_pos)
    windows = hasattr(m, "get_vision_window_index")  # Qwen2.5-VL; Qwen2-VL's tower has no windows
    targets = []

    def get_vision_position_ids(*args, **kwargs):
        a = bind_pos(*args, **kwargs)
        kw, merge = a.get("kwargs"), a["spatial_merge_size"]
        if (kw is not None and kw.get("position_ids") is not None) or a.get("include_temporal") or \
                not isinstance(merge, int):
            return orig_pos(*args, **kwargs)
        return _positions.vision_positions(a["grid_thw"], merge)

    def stash(kw, w, flash):
        if kw.get("window_index") is None and kw.get("cu_window_seqlens") is None:
            kw["window_index"], kw["cu_window_seqlens"] = w.window_index, w.cu_window_seqlens
            if flash and kw.get("max_window_seqlen") is None:
                kw["max_window_seqlen"] = w.max_window_seqlen

    if not windows:
        pass  # Qwen2-VL: cu_seqlens is per frame, transformers' own
    elif hasattr(m, "get_vision_attention_seqlens"):
        orig_seq = m.get_vision_attention_seqlens
        bind_seq = _binder(orig_seq)

        def get_vision_attention_seqlens(*args, **kwargs):
            a = bind_seq(*args, **kwargs)
            kw, config = a.get("kwargs"), a["config"]
            if a.get("merge_temporal") or kw is None or kw.get("cu_seqlens") is not None or \
                    not hasattr(config, "window_size"):
                return orig_seq(*args, **kwargs)
            w = _positions.window_index(a["grid_thw"], config.spatial_merge_size, config.window_size,
                                        config.patch_size)
            flash = flash_requested is not None and flash_requested(config)
            stash(kw, w, flash)
            max_seqlen = kw.pop("max_seqlen", None)
            if max_seqlen is None and flash:
                max_seqlen = w.max_seqlen
            return w.cu_seqlens, max_seqlen
        targets.append((m, "get_vision_attention_seqlens", get_vision_attention_seqlens))
    elif not hasattr(m, "get_vision_cu_seqlens"):  # 5.10-5.14: that hook (no config) stays transformers'
        raise _unknown(spec, "positions (vision hooks)", v)

    if not windows:
        return targets + [(m, "get_vision_position_ids", get_vision_position_ids)]
    orig_win = m.get_vision_window_index
    bind_win = _binder(orig_win)

    def get_vision_window_index(*args, **kwargs):
        a = bind_win(*args, **kwargs)
        kw = a.get("kwargs")
        if kw is not None and kw.get("window_index") is not None and kw.get("cu_window_seqlens") is not None:
            return orig_win(*args, **kwargs)
        w = _positions.window_index(a["grid_thw"], a["spatial_merge_size"], a["window_size"], a["patch_size"])
        return w.window_index, w.cu_window_seqlens

    return targets + [(m, "get_vision_position_ids", get_vision_position_ids),
                      (m, "get_vision_window_index", get_vision_window_index)]


# ---- rotary embeddings ----------------------------------------------------------------------------

def rope_targets(spec, m, v):
    targets = []
    if hasattr(m, "apply_rotary_pos_emb"):  # 5.17+: tables already in mRoPE layout
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if unsqueeze_dim != 1 or cos.dim() != 3:
                raise ValueError("mmfuse patch: apply_rotary_pos_emb: expected [B, H, L, D] q/k and [B, L, D] tables")
            return _rope.mrope(q, k, cos, sin, numerics="hf_eager")  # [B, H, L, D] (bhld)
        targets.append((m, "apply_rotary_pos_emb", apply_rotary_pos_emb))
    if hasattr(m, "apply_multimodal_rotary_pos_emb"):  # up to 5.16: [3, B, L, D] tables and the sections
        def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
            if unsqueeze_dim != 1 or cos.dim() != 4:
                raise ValueError("mmfuse patch: apply_multimodal_rotary_pos_emb: expected [B, H, L, D] q/k and "
                                 "[3, B, L, D] tables")
            return _rope.mrope(q, k, cos, sin, mrope_section=list(mrope_section), numerics="hf_eager")
        targets.append((m, "apply_multimodal_rotary_pos_emb", apply_multimodal_rotary_pos_emb))
    if not targets or not hasattr(m, "apply_rotary_pos_emb_vision"):
        raise _unknown(spec, "rope functions", v)

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        # q, k [N, H, D]; cos, sin [N, D]: plain RoPE with fp32 tables, fp32 math, one rounding
        qo, ko = _rope.mrope(q[None], k[None], cos[None].float(), sin[None].float(), numerics="fp32",
                             qk_layout="blhd")
        return qo[0], ko[0]
    return targets + [(m, "apply_rotary_pos_emb_vision", apply_rotary_pos_emb_vision)]


# ---- RMSNorm and the MLPs ----------------------------------------------------------------------

def rms_norm_class(spec, m, v=(0,)):
    for name in spec.norms:
        if hasattr(m, name):
            return getattr(m, name)
    raise _unknown(spec, "rms_norm classes", v)


def rms_norm_targets(spec, m, v):
    cls = rms_norm_class(spec, m, v)
    orig = cls.forward

    def forward(self, hidden_states):
        if self.weight.dtype != hidden_states.dtype:  # transformers' mixed-dtype rounding stays its own
            return orig(self, hidden_states)
        return _rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return [(cls, "forward", forward)]


def _is_silu(act):
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def swiglu_targets(spec, m, v):
    targets = []
    for cls in (getattr(m, n) for n in spec.mlps):
        orig = cls.forward

        def forward(self, x, _orig=orig):
            if not _is_silu(self.act_fn):
                return _orig(self, x)
            g, u = self.gate_proj, self.up_proj
            if type(g) is torch.nn.Linear and type(u) is torch.nn.Linear:  # one GEMM, the stacked weight
                bias = None if g.bias is None else torch.cat([g.bias, u.bias])
                gate_up = F.linear(x, torch.cat([g.weight, u.weight]), bias)
            else:  # their own modules (Fp8Linear): two GEMMs, the outputs side by side
                gate_up = torch.cat([g(x), u(x)], dim=-1)
            return self.down_proj(_swiglu(gate_up))
        targets.append((cls, "forward", forward))
    return targets


def window_attention_layout(fn) -> Optional[str]:
    """The layout of a vision attention forward: ``"loop"`` (4.52+: with SDPA, one call a window of
    cu_seqlens), ``"masked"`` (4.49-4.51's SDPA class: one call over every patch under a
    block-diagonal mask), or None (another: left to transformers)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    if "self.qkv(" not in src or "self.proj(" not in src or "apply_rotary_pos_emb_vision(" not in src:
        return None
    if "lengths.tolist()" in src and "torch.split(" in src:
        return "loop"
    if "attention_mask = torch.zeros([1, seq_length, seq_length]" in src and "scaled_dot_product_attention(" in src:
        return "masked"
    return None


def vision_attention_targets(spec, m, v):
    targets = []
    for cls in (getattr(m, n) for n in spec.vision_attention if hasattr(m, n)):
        layout = window_attention_layout(cls.forward)
        if layout is not None:
            targets.append((cls, "forward", _window_attention_forward(m, cls.forward, layout)))
    return targets


def _window_attention_forward(m, orig, layout):
    bind = _binder(orig)

    def forward(self, *args, **kwargs):
        a = bind(self, *args, **kwargs)
        pe = a.get("position_embeddings")
        sdpa = layout == "masked" or self.config._attn_implementation == "sdpa"
        if not sdpa or pe is None or (self.training and getattr(self, "attention_dropout", 0.0)):
            return orig(self, *args, **kwargs)
        x = a["hidden_states"]
        S = x.shape[0]
        q, k, val = self.qkv(x).reshape(S, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = m.apply_rotary_pos_emb_vision(q, k, *pe)  # the module's, patched or not, as transformers calls it
        # transformers' own scale where it passes one (4.52+), SDPA's default where it does not
        out = _windows.sdpa_by_windows(q, k, val, _windows.window_lengths(a["cu_seqlens"]),
                                       getattr(self, "scaling", None))
        return self.proj(out.reshape(S, -1))
    return forward


def linear_cross_entropy_targets(spec, m, v):
    cls = getattr(m, spec.for_cg)
    return [(cls, "forward", wrap_forward(cls.forward))]


__all__ = ["QWEN2_5_VL", "QWEN2_VL", "QWEN3_VL", "SUPPORTED", "Spec", "linear_cross_entropy_targets", "modeling",
           "rms_norm_class", "rms_norm_targets", "rope_index_owner", "rope_targets", "swiglu_targets",
           "text_positions_targets", "version_tuple", "vision_attention_targets", "vision_positions_targets",
           "window_attention_layout"]
