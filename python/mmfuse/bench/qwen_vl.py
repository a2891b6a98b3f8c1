"""A random-weight Qwen2.5-VL (or Qwen2-VL) of the installed transformers (any layout 4.49-5.x) and a
multimodal batch for it: the model of ``mmfuse-bench model`` and of the integration tests.

Image and video spans are a vision start token, ``t * (h/2) * (w/2)`` image (video) tokens and a vision
end token; every sample is one row of such segments, padded to the batch's length on either side."""

import inspect
from typing import Dict, List, Sequence, Tuple

import torch

# token ids of the toy vocabularies (the 3B preset uses Qwen's own)
TOY_IDS = dict(image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153)
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                vision_end_token_id=151653)

PRESETS: Dict[str, dict] = {
    # Qwen2.5-VL-3B's text and vision shapes (layers and vision depth set by the caller)
    "3b": dict(text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                         num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=[16, 24, 24],
                         tie_word_embeddings=True, max_position_embeddings=128000),
               vision=dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, window_size=112, tokens_per_second=2,
                           temporal_patch_size=2, in_channels=3),
               ids=QWEN_IDS),
    # the same structure at toy sizes (CPU; the integration tests)
    "tiny": dict(text=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, mrope_section=[2, 3, 3],
                           tie_word_embeddings=False, max_position_embeddings=512),
                 vision=dict(hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                             spatial_merge_size=2, window_size=56, tokens_per_second=2, temporal_patch_size=2,
                             in_channels=3),
                 # Qwen2-VL's vision config names
                 vision_qwen2=dict(embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                                   spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
                 # Qwen3-VL's (patch 16: an image's patch is 3 * 2 * 16 * 16 values)
                 vision_qwen3=dict(hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                   patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                                   num_position_embeddings=64, deepstack_visual_indexes=[1]),
                 ids=TOY_IDS),
}


def _spec(family: str):
    from ..integrations import qwen_vl
    return {"qwen2_5_vl": qwen_vl.QWEN2_5_VL, "qwen2_vl": qwen_vl.QWEN2_VL, "qwen3_vl": qwen_vl.QWEN3_VL}[family]


def takes_token_types(family: str = "qwen2_5_vl") -> bool:
    """Whether the installed get_rope_index takes ``mm_token_type_ids`` (transformers 5.3+)."""
    from ..integrations import qwen_vl
    spec = _spec(family)
    m, _ = qwen_vl.modeling(spec)
    return "mm_token_type_ids" in inspect.signature(qwen_vl.rope_index_owner(spec, m).get_rope_index).parameters


def make_model(preset: str = "tiny", *, family: str = "qwen2_5_vl", layers: int = 2, vision_depth: int = 3,
               fullatt: Sequence[int] = (1,), device="cpu", dtype=torch.float32, attn: str = "eager", seed: int = 0):
    """``Qwen2_5_VLForConditionalGeneration`` (``family="qwen2_vl"``: ``Qwen2VLForConditionalGeneration``)
    of the preset's shapes with random weights (eval mode)."""
    import transformers
    from ..integrations import qwen_vl

    _, version = qwen_vl.modeling(_spec(family))
    p = PRESETS[preset]
    text = dict(p["text"])
    theta, section = text.pop("rope_theta"), text.pop("mrope_section")
    rope = dict(rope_type="default", mrope_section=list(section))
    if version >= (5,):
        text["rope_parameters"] = dict(rope, rope_theta=theta)
    else:
        text.update(rope_scaling=dict(rope, type="mrope"), rope_theta=theta)
    if family == "qwen3_vl":  # nested configs only, head_dim given, rope_parameters
        text.update(num_hidden_layers=layers, head_dim=text["hidden_size"] // text["num_attention_heads"],
                    rope_parameters=dict(rope, rope_theta=theta))
        text.pop("tie_word_embeddings")
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=dict(p["vision_qwen3"], depth=vision_depth),
                                         **p["ids"])
        cfg._attn_implementation = attn
        cfg.text_config._attn_implementation = cfg.vision_config._attn_implementation = attn
        torch.manual_seed(seed)
        return transformers.Qwen3VLForConditionalGeneration(cfg).to(device=device, dtype=dtype).eval()
    if family == "qwen2_vl":
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(p["vision_qwen2"], depth=vision_depth)
    else:
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(p["vision"], depth=vision_depth, fullatt_block_indexes=list(fullatt))
    cfg = config_cls(num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, **text, **p["ids"], vision_config=vision)
    cfg._attn_implementation = attn
    if hasattr(cfg, "vision_config"):
        cfg.vision_config._attn_implementation = attn
    if hasattr(cfg, "text_config"):
        cfg.text_config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(cfg).to(device=device, dtype=dtype).eval()


Segment = Tuple[str, object]  # ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w)), h and w in patches


def make_batch(rows: List[List[Segment]], *, ids: dict, vocab: int, length: int = 0, left_padded: Sequence[int] = (),
               device="cpu", dtype=torch.float32, seconds_per_grid: float = 1.0, seed: int = 1, merge: int = 2,
               patch: int = 3 * 2 * 14 * 14, family: str = "qwen2_5_vl") -> dict:
    """Model inputs for ``rows`` of segments: text tokens drawn from ``[3, vocab)`` minus the special ids,
    each image / video span with its grid; rows padded to ``length`` (at least the longest), on the
    left for the rows in ``left_padded``. Includes ``mm_token_type_ids`` where the installed
    transformers takes it, and ``labels`` (the text tokens; vision and padding -100)."""
    g = torch.Generator().manual_seed(seed)
    special = set(ids.values())
    seqs, types, images, videos = [], [], [], []
    for row in rows:
        s, ty = [], []
        for kind, arg in row:
            if kind == "text":
                tok = torch.randint(3, vocab, (int(arg),), generator=g)
                for sp in special:
                    tok[tok == sp] = 3
                s += tok.tolist()
                ty += [0] * int(arg)
            else:
                t, h, w = arg
                n = t * (h // merge) * (w // merge)
                tok_id, code = (ids["image_token_id"], 1) if kind == "image" else (ids["video_token_id"], 2)
                s += [ids["vision_start_token_id"]] + [tok_id] * n + [ids["vision_end_token_id"]]
                ty += [0] + [code] * n + [0]
                (images if kind == "image" else videos).append([t, h, w])
        seqs.append(s)
        types.append(ty)
    L = max(length, max(len(s) for s in seqs))
    B = len(rows)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    tt = torch.zeros(B, L, dtype=torch.long)
    for b, (s, ty) in enumerate(zip(seqs, types)):
        o = L - len(s) if b in left_padded else 0
        input_ids[b, o:o + len(s)] = torch.tensor(s)
        mask[b, o:o + len(s)] = 1
        tt[b, o:o + len(s)] = torch.tensor(ty)
    labels = input_ids.masked_fill((mask == 0) | (tt != 0) | torch.isin(input_ids, torch.tensor(sorted(special))),
                                   -100)
    batch = dict(input_ids=input_ids.to(device), attention_mask=mask.to(device))
    for key, grids in (("image", images), ("video", videos)):
        if grids:
            n = sum(t * h * w for t, h, w in grids)
            pix = "pixel_values" if key == "image" else "pixel_values_videos"
            batch[pix] = torch.randn(n, patch, generator=g).to(device, dtype)
            batch[f"{key}_grid_thw"] = torch.tensor(grids).to(device)
    if videos and family == "qwen2_5_vl":
        batch["second_per_grid_ts"] = torch.full((len(videos),), seconds_per_grid).to(device)
    if takes_token_types(family):
        batch["mm_token_type_ids"] = tt.to(device)
    batch["labels"] = labels.to(device)
    return batch


__all__ = ["PRESETS", "make_batch", "make_model", "takes_token_types"]
