"""mmfuse.integrations.transformers: a tiny random-weight Qwen2.5-VL (transformers 5.x), patched against
unpatched, on a batch of text, images and a video with padding: equal logits and gradients."""

import pytest
import torch

from mmfuse.bench.references import hf5_get_rope_index

pytestmark = pytest.mark.skipif(hf5_get_rope_index() is None, reason="needs transformers 5.x")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
IMG, VID, VS, VE = 151, 152, 150, 153


def _model(device, dtype):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
                           tokens_per_second=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg).to(device=device, dtype=dtype).eval()


def _batch(device, dtype):
    g = torch.Generator().manual_seed(1)
    img = [[1, 8, 12], [1, 6, 4]]  # merged 4 x 6 (window side 56/2/14 = 2) and 3 x 2
    vid = [[2, 4, 8]]
    rows = [[5, 6, VS] + [IMG] * 24 + [VE, 7, 8, VS] + [VID] * 16 + [VE, 9],
            [10, VS] + [IMG] * 6 + [VE, 11, 12, 13]]
    L = max(len(r) for r in rows) + 2
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for b, r in enumerate(rows):  # row 0 right-padded, row 1 left-padded
        s = 0 if b == 0 else L - len(r)
        ids[b, s:s + len(r)] = torch.tensor(r)
        mask[b, s:s + len(r)] = 1
    types = ((ids == IMG).long() + 2 * (ids == VID).long()) * mask
    patch = 3 * 2 * 14 * 14
    n_img = sum(t * h * w for t, h, w in img)
    n_vid = sum(t * h * w for t, h, w in vid)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), mm_token_type_ids=types.to(device),
                pixel_values=torch.randn(n_img, patch, generator=g).to(device, dtype),
                image_grid_thw=torch.tensor(img).to(device),
                pixel_values_videos=torch.randn(n_vid, patch, generator=g).to(device, dtype),
                video_grid_thw=torch.tensor(vid).to(device), second_per_grid_ts=torch.tensor([1.0]).to(device))


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    logits = out.logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().clone(), grads, model.model.rope_deltas.clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_equals_unpatched(device, dtype):
    from mmfuse.integrations.transformers import patch_qwen2_5_vl
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    model = _model(device, dtype)
    batch = _batch(device, dtype)
    before = m.apply_rotary_pos_emb, m.Qwen2_5_VLModel.get_rope_index
    want_logits, want_grads, want_deltas = _run(model, batch)
    calls = []
    with patch_qwen2_5_vl():
        assert m.apply_rotary_pos_emb is not before[0]
        import mmfuse.positions as P
        orig = P.rope_index
        P.rope_index = lambda *a, **k: calls.append(1) or orig(*a, **k)  # the patch really runs mmfuse
        try:
            got_logits, got_grads, got_deltas = _run(model, batch)
        finally:
            P.rope_index = orig
    assert calls
    assert (m.apply_rotary_pos_emb, m.Qwen2_5_VLModel.get_rope_index) == before  # reverted
    assert torch.equal(got_deltas, want_deltas)
    assert torch.equal(got_logits, want_logits)  # bitwise: positions exact, RoPE in the matching numerics
    assert got_grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=0, atol=0, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_mlp_patch_close_to_unpatched(device, dtype):
    """rms_norm=True, swiglu=True: every RMSNorm and MLP of the text and vision towers through mmfuse
    (counted), logits and gradients close to transformers' own (fp32 tight; bf16 to bf16 rounding),
    reverted after."""
    from mmfuse.integrations.transformers import patch_qwen2_5_vl
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    import mmfuse.integrations.transformers as integ

    model = _model(device, dtype)
    batch = _batch(device, dtype)
    before = (m.Qwen2_5_VLRMSNorm.forward, m.Qwen2MLP.forward, m.Qwen2_5_VLMLP.forward)
    want_logits, want_grads, _ = _run(model, batch)
    calls = {"norm": 0, "swiglu": 0}
    orig_norm, orig_swiglu = integ._rms_norm, integ._swiglu
    integ._rms_norm = lambda *a, **k: calls.__setitem__("norm", calls["norm"] + 1) or orig_norm(*a, **k)
    integ._swiglu = lambda *a, **k: calls.__setitem__("swiglu", calls["swiglu"] + 1) or orig_swiglu(*a, **k)
    try:
        with patch_qwen2_5_vl(rms_norm=True, swiglu=True):
            got_logits, got_grads, _ = _run(model, batch)
    finally:
        integ._rms_norm, integ._swiglu = orig_norm, orig_swiglu
    # text: 2 layers x 2 norms + the final one; vision: 3 blocks x 2 norms (+ the merger's); MLPs: 2 + 3
    assert calls["norm"] >= 2 * 2 + 1 + 3 * 2 and calls["swiglu"] >= 2 + 3
    assert (m.Qwen2_5_VLRMSNorm.forward, m.Qwen2MLP.forward, m.Qwen2_5_VLMLP.forward) == before
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    rel = float((got_logits.float() - want_logits.float()).norm() / want_logits.float().norm())
    assert rel <= tol, rel
    for n, g in want_grads.items():
        err = float((got_grads[n].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30))
        assert err <= (1e-3 if dtype == torch.float32 else 0.1), (n, err)
