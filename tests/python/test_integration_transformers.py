"""mmfuse.integrations.transformers: a tiny random-weight Qwen2.5-VL (and Qwen2-VL) of the installed transformers
(4.49-4.57 or 5.x; CI runs the oldest and newest of each), patched against unpatched, on a batch of
text, images and a video with padding: equal logits and gradients where the patch is exact, close where
it rounds differently, the loss without logits, fp8 and the Trainer callback, and every change reverted."""

import inspect
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmfuse.bench.qwen_vl import PRESETS, make_batch, make_model, takes_token_types  # noqa: E402
from mmfuse.integrations import qwen_vl as Q  # noqa: E402
from mmfuse.integrations.transformers import (PatchCallback, patch_qwen2_5_vl, patch_qwen2_vl,  # noqa: E402
                                              patch_qwen3_vl)

m, VERSION = Q.modeling()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HAS_TYPES = takes_token_types()
FAMILIES = {"qwen2_5_vl": (Q.QWEN2_5_VL, patch_qwen2_5_vl), "qwen2_vl": (Q.QWEN2_VL, patch_qwen2_vl)}
if hasattr(transformers, "Qwen3VLForConditionalGeneration"):  # 4.57+
    FAMILIES["qwen3_vl"] = (Q.QWEN3_VL, patch_qwen3_vl)


def _model(device, dtype, family="qwen2_5_vl"):
    return make_model("tiny", family=family, layers=2, vision_depth=3, fullatt=(1,), device=device, dtype=dtype)


def _batch(device, dtype, labels=False, family="qwen2_5_vl"):
    """Two rows: text, an image (merged 4 x 6, window side 56/2/14 = 2), text, a video, text, right-padded;
    text, a smaller image, text, left-padded."""
    rows = [[("text", 2), ("image", (1, 8, 12)), ("text", 2), ("video", (2, 4, 8)), ("text", 1)],
            [("text", 1), ("image", (1, 6, 4)), ("text", 3)]]
    patch = 3 * 2 * 14 * 14
    if family == "qwen3_vl":  # images only (its videos come with timestamp tokens); 16-pixel patches
        rows[0][3] = ("image", (1, 4, 8))
        patch = 3 * 2 * 16 * 16
    p = PRESETS["tiny"]
    b = make_batch(rows, ids=p["ids"], vocab=p["text"]["vocab_size"], length=45, left_padded=(1,), device=device,
                   dtype=dtype, family=family, patch=patch)
    if not labels:
        del b["labels"]
    return b


def _deltas(model):
    return getattr(model.model, "rope_deltas", None) if getattr(model, "rope_deltas", None) is None else \
        model.rope_deltas


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    logits = out.logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().clone(), grads, _deltas(model).clone()


def _snapshot(spec=Q.QWEN2_5_VL):
    """Every attribute a full patch may touch, as it is now."""
    mod, _ = Q.modeling(spec)
    owners = [mod, getattr(mod, spec.model), getattr(mod, spec.for_cg), getattr(mod, spec.vision),
              Q.rms_norm_class(spec, mod)] + [getattr(mod, n) for n in spec.mlps]
    owners += [getattr(mod, n) for n in spec.vision_attention if hasattr(mod, n)]
    return [dict(vars(o)) for o in owners]


def _counting(monkeypatch, module, name, calls):
    orig = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.__setitem__(name, calls.get(name, 0) + 1) or orig(*a, **k))


# 5.3-5.7's get_rope_index differs from every other release (see qwen2_5_vl.text_positions_targets)
POSITIONS = not (HAS_TYPES and VERSION < (5, 8))
BASE = dict(positions=POSITIONS)
EXACT = dict(BASE, rms_norm=False, swiglu=False, linear_cross_entropy=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positions_and_rope_exact(device, dtype, family, monkeypatch):
    """positions=True, rope=True: logits, rope deltas and gradients bitwise equal to transformers'."""
    import mmfuse.positions as P
    import mmfuse.rope as R

    spec, patch = FAMILIES[family]
    model = _model(device, dtype, family)
    batch = _batch(device, dtype, family=family)
    before = _snapshot(spec)
    want_logits, want_grads, want_deltas = _run(model, batch)
    calls = {}
    for mod, name in ((P, "rope_index"), (P, "window_index"), (R, "mrope")):
        _counting(monkeypatch, mod, name, calls)
    positions = POSITIONS and family != "qwen3_vl"  # Qwen3-VL's positions stay transformers'
    with patch(**dict(EXACT, positions=positions)):
        assert _snapshot(spec) != before
        got_logits, got_grads, got_deltas = _run(model, batch)
    windows = family == "qwen2_5_vl"
    assert calls.get("mrope") and (not positions or calls.get("rope_index") and
                                   bool(calls.get("window_index")) == windows), calls
    assert _snapshot(spec) == before  # reverted
    assert torch.equal(got_deltas, want_deltas)
    assert torch.equal(got_logits, want_logits)
    assert got_grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=0, atol=0, msg=lambda s: f"{n}: {s}")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_attention_by_windows(device, dtype, family, monkeypatch):
    """vision_attention=True with SDPA: the tower's windows through batched SDPA calls (counted), logits
    and gradients equal to transformers' own where it calls SDPA once a window (4.52+), close where it
    makes one masked call (4.49-4.51)."""
    from mmfuse.integrations import window_attention as W

    spec, patch = FAMILIES[family]
    model = make_model("tiny", family=family, layers=2, vision_depth=3, fullatt=(1,), device=device, dtype=dtype,
                       attn="sdpa")
    batch = _batch(device, dtype, family=family)
    before = _snapshot(spec)
    want_logits, want_grads, _ = _run(model, batch)
    calls = {}
    _counting(monkeypatch, W, "sdpa_by_windows", calls)
    with patch(positions=False, rope=False, rms_norm=False, swiglu=False, linear_cross_entropy=False):
        got_logits, got_grads, _ = _run(model, batch)
    assert _snapshot(spec) == before
    mod = Q.modeling(spec)[0]
    layouts = {Q.window_attention_layout(getattr(mod, n).forward) for n in spec.vision_attention if hasattr(mod, n)}
    layouts.discard(None)
    assert layouts, "every supported transformers has one of the two layouts"
    # every block of the tower, which runs for the images and for the video
    assert calls.get("sdpa_by_windows", 0) == (3 * 2 if layouts else 0), (calls, layouts)
    if "masked" in layouts:  # another summation than one masked call over every patch: close, as RMSNorm's
        assert _rel(got_logits, want_logits) <= (1e-5 if dtype == torch.float32 else 5e-2)
        for n, g in want_grads.items():
            assert _rel(got_grads[n], g) <= (1e-4 if dtype == torch.float32 else 0.1), n
        return
    tol = dict(rtol=0, atol=0) if device == "cuda" else dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 \
        else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_logits, want_logits, **tol)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, **tol, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_mlp_close_to_unpatched(device, dtype, family, monkeypatch):
    """rms_norm=True, swiglu=True: every RMSNorm and MLP of the text and vision towers through mmfuse
    (counted), logits and gradients close to transformers' own (fp32 tight; bf16 to bf16 rounding)."""
    spec, patch = FAMILIES[family]
    model = _model(device, dtype, family)
    batch = _batch(device, dtype, family=family)
    before = _snapshot(spec)
    want_logits, want_grads, _ = _run(model, batch)
    calls = {}
    _counting(monkeypatch, Q, "_rms_norm", calls)
    _counting(monkeypatch, Q, "_swiglu", calls)
    with patch(**dict(BASE, positions=BASE["positions"] and family != "qwen3_vl"), linear_cross_entropy=False):
        got_logits, got_grads, _ = _run(model, batch)
    # text: 2 layers x 2 norms + the final one (Qwen2.5-VL's vision: 3 blocks x 2 norms, the merger's,
    # and 3 MLPs more)
    vision = family == "qwen2_5_vl"
    assert calls["_rms_norm"] >= 2 * 2 + 1 + vision * 3 * 2 and calls["_swiglu"] >= 2 + vision * 3, calls
    assert _snapshot(spec) == before
    assert _rel(got_logits, want_logits) <= (1e-4 if dtype == torch.float32 else 5e-2)
    for n, g in want_grads.items():
        assert _rel(got_grads[n], g) <= (1e-3 if dtype == torch.float32 else 0.1), n


def _train_step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_loss(device, dtype, family, monkeypatch):
    """linear_cross_entropy=True in training: the loss through mmfuse.linear_cross_entropy (counted), no
    logits, loss and gradients close to transformers' causal-LM loss; in eval the logits come back."""
    from mmfuse.integrations import causal_lm_loss as C

    patch = FAMILIES[family][1]
    model = _model(device, dtype, family).train()
    batch = _batch(device, dtype, labels=True, family=family)
    want, want_grads = _train_step(model, batch)
    calls = {}
    _counting(monkeypatch, C, "linear_cross_entropy", calls)
    with patch(**dict(EXACT, linear_cross_entropy=True, positions=EXACT["positions"] and family != "qwen3_vl")):
        got, got_grads = _train_step(model, batch)
        assert got.logits is None and calls.get("linear_cross_entropy") == 1
        assert got["loss"] is got.loss and got[0] is got.loss and "logits" not in got.keys()  # as transformers
        model.eval()
        with torch.no_grad():
            ev = model(**batch)
        assert ev.logits is not None and calls["linear_cross_entropy"] == 1
        model.train()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got_loss, want_loss = float(got.loss.detach()), float(want.loss.detach())
    assert abs(got_loss - want_loss) <= tol * abs(want_loss), (got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        assert _rel(got_grads[n], g) <= (1e-4 if dtype == torch.float32 else 0.1), n


@pytest.mark.skipif(not any(p.kind is p.VAR_KEYWORD for p in
                            inspect.signature(m.Qwen2_5_VLForConditionalGeneration.forward).parameters.values()),
                    reason="this transformers' forward takes no loss kwargs")
def test_linear_cross_entropy_num_items_in_batch():
    """The Trainer's num_items_in_batch: the sum over the batch divided by it, as transformers does."""
    model = _model("cpu", torch.float32).train()
    batch = _batch("cpu", torch.float32, labels=True)
    want, _ = _train_step(model, batch, num_items_in_batch=torch.tensor(7))
    with patch_qwen2_5_vl(**dict(EXACT, linear_cross_entropy=True)):
        got, _ = _train_step(model, batch, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)


def test_fp8_converts_and_restores():
    """fp8=True: the model's linears but lm_head become Fp8Linear (sharing the parameters; fp8 emulated
    on the CPU), the loss stays close, and revert puts the very same nn.Linear modules back."""
    from mmfuse.nn import Fp8Linear

    model = _model("cpu", torch.bfloat16).train()
    batch = _batch("cpu", torch.bfloat16, labels=True)
    linears = {n: mod for n, mod in model.named_modules() if type(mod) is torch.nn.Linear}
    want, _ = _train_step(model, batch)
    with patch_qwen2_5_vl(model, **BASE, fp8=True):
        converted = {n: mod for n, mod in model.named_modules() if isinstance(mod, Fp8Linear)}
        assert set(converted) == {n for n in linears if not n.endswith("lm_head")}
        assert all(converted[n].weight is linears[n].weight for n in converted)
        got, grads = _train_step(model, batch)
    assert {n: mod for n, mod in model.named_modules() if type(mod) is torch.nn.Linear} == linears
    assert abs(float(got.loss.detach()) - float(want.loss.detach())) <= 0.05 * abs(float(want.loss.detach()))
    assert all(torch.isfinite(g).all() for g in grads.values())
    with pytest.raises(ValueError, match="fp8=True converts the model's linears: pass the model"):
        patch_qwen2_5_vl(fp8=True)


def test_trainer_callback_applies_and_reverts():
    """PatchCallback: the patch is on between on_train_begin and on_train_end, with the model it is given."""
    model = _model("cpu", torch.float32)
    before = _snapshot()  # after a model is made (transformers caches facts on the classes then)
    cb = PatchCallback(**BASE)
    cb.on_train_begin(None, None, None, model=model)
    assert _snapshot() != before and cb.patch.model is model
    cb.on_train_end(None, None, None)
    assert _snapshot() == before and cb.patch is None


def test_patch_refuses_twice_and_unsupported_versions(monkeypatch):
    if not POSITIONS:
        with pytest.raises(ImportError, match=r"get_rope_index \(5.3-5.7\).*pass positions=False"):
            patch_qwen2_5_vl().apply()
    p = patch_qwen2_5_vl(**BASE).apply()
    try:
        with pytest.raises(RuntimeError, match="already applied"):
            p.apply()
    finally:
        p.revert()
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.45.2")  # the module as imported now
    with pytest.raises(ImportError, match="transformers 4.45.2 has no Qwen2.5-VL layout mmfuse patches: supported"):
        patch_qwen2_5_vl().apply()


def test_trainer_with_patch_callback(tmp_path, monkeypatch):
    """A transformers Trainer run with PatchCallback: the loss goes through linear_cross_entropy (counted)
    in every step, the losses match an unpatched run from the same weights, and the patch is off after."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from mmfuse.integrations import causal_lm_loss as C

    batch = _batch("cpu", torch.float32, labels=True)

    class OneBatch(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return batch

    def run(callbacks):
        model = _model("cpu", torch.float32).train()
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=1,
                                 learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                                 disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=OneBatch(), data_collator=lambda items: items[0],
                          callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    want = run([])
    before = _snapshot()
    calls = {}
    _counting(monkeypatch, C, "linear_cross_entropy", calls)
    got = run([PatchCallback(**BASE)])
    assert calls.get("linear_cross_entropy") == 3 and _snapshot() == before
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-3 * abs(w), (got, want)


@pytest.mark.skipif("qwen3_vl" not in FAMILIES, reason="this transformers has no Qwen3-VL")
def test_qwen3_positions_refused():
    with pytest.raises(ValueError, match="Qwen3-VL's position ids .* are not covered"):
        patch_qwen3_vl(positions=True)
