"""``mmfuse-bench model``: the training step of a whole Qwen2.5-VL of the installed transformers (random
weights, Qwen2.5-VL-3B shapes, a few layers, images in the batch), unpatched against
``patch_qwen2_5_vl`` (positions, RoPE, RMSNorm, SwiGLU, the loss through fused linear cross-entropy;
``--fp8`` adds the fp8 linears), eager and ``torch.compile``, in one run.

Columns: ms a step (forward with labels + backward, gradients set to None first), tokens/s, the speedup
over each unpatched variant, the peak memory a step adds to what the weights and the batch hold (its
gradients included), and agreement with unpatched eager: the largest relative gradient error of a
parameter at the first step, and the loss after ``--steps`` AdamW steps from the same weights on the
same batch. On the CPU: the tiny preset in fp32, eager only, agreement only."""

import argparse
import math
import time
from typing import List, Optional

import torch

from ..integrations.transformers import patch_qwen2_5_vl
from .common import add_step_ratios, print_step_table, time_us, verify_step_rows
from .qwen_vl import PRESETS, make_batch, make_model


def _rows_of(preset: str, batch: int, seq: int) -> List[list]:
    """Each sample: text, an image, text, a second image, text to ``seq`` tokens (images sized for the
    preset: 56 x 56 and 40 x 60 patches at 3B shapes)."""
    if preset == "tiny":
        return [[("text", 5), ("image", (1, 8, 12)), ("text", 4), ("image", (1, 4, 4)), ("text", 6)]
                for _ in range(batch)]
    img = 2 + 28 * 28 + 2 + 20 * 30
    if seq < img + 64:
        raise ValueError(f"mmfuse-bench model: --seq: expected at least {img + 64} tokens (two images), got {seq}")
    rest = seq - img
    return [[("text", rest // 4), ("image", (1, 56, 56)), ("text", rest // 4), ("image", (1, 40, 60)),
             ("text", rest - 2 * (rest // 4))] for _ in range(batch)]


class _Variant:
    def __init__(self, name: str, patch: Optional[dict], compiled: bool):
        self.name, self.patch, self.compiled = name, patch, compiled


def _step(fn, model, batch):
    for p in model.parameters():
        p.grad = None
    loss = fn(**batch).loss
    loss.backward()
    return loss


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel_err(ref, got) -> float:
    worst = 0.0
    for n, r in ref.items():
        g = got.get(n)
        if g is None:
            return math.inf
        den = float(r.double().norm())
        if den > 0:
            worst = max(worst, float((g.double() - r.double()).norm()) / den)
    return worst


def _train_losses(fn, model, batch, steps: int, lr: float) -> List[float]:
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        losses.append(float(_step(fn, model, batch).detach()))
        opt.step()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
            p.grad = None
    return losses


def _peak_extra_bytes(fn, model, batch) -> int:
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _step(fn, model, batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run(device: str, *, layers: int = 4, vision_depth: int = 4, batch: int = 2, seq: int = 4096, steps: int = 20,
        lr: float = 1e-5, fp8: bool = False, compile: bool = True, quick: bool = False) -> dict:
    on_gpu = device == "cuda"
    preset = "3b" if on_gpu else "tiny"
    if not on_gpu:
        layers, vision_depth, batch, steps = 2, 3, 2, min(steps, 3)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = make_model(preset, layers=layers, vision_depth=vision_depth, fullatt=(vision_depth - 1,), device=device,
                       dtype=dtype, attn="sdpa" if on_gpu else "eager").train()
    p = PRESETS[preset]
    data = make_batch(_rows_of(preset, batch, seq), ids=p["ids"], vocab=p["text"]["vocab_size"], device=device,
                      dtype=dtype)
    B, L = data["input_ids"].shape
    print(f"\n## model: Qwen2.5-VL ({preset} shapes, {layers} text layers, vision depth {vision_depth}), batch {B} x "
          f"{L} tokens with two images each, {str(dtype).replace('torch.', '')}", flush=True)
    full = dict()
    variants = [_Variant("transformers eager", None, False)]
    if on_gpu and compile:
        variants.append(_Variant("transformers compiled", None, True))
    variants.append(_Variant("mmfuse patch eager", full, False))
    if on_gpu and compile:
        variants.append(_Variant("mmfuse patch compiled", full, True))
    if fp8 and on_gpu:
        variants.append(_Variant("mmfuse patch fp8 eager", dict(fp8=True), False))
        if compile:
            variants.append(_Variant("mmfuse patch fp8 compiled", dict(fp8=True), True))
    it = 5 if quick else 20
    rows, failed = [], {}
    ref_grads = ref_losses = None
    for v in variants:
        t0 = time.perf_counter()
        torch._dynamo.reset()
        patch = patch_qwen2_5_vl(model, **v.patch) if v.patch is not None else None
        try:
            if patch is not None:
                patch.apply()
            fn = torch.compile(model) if v.compiled else model
            _step(fn, model, data)
            grads = _grads(model)
            if ref_grads is None:
                ref_grads = grads
            err = _max_rel_err(ref_grads, grads)
            losses = _train_losses(fn, model, data, steps, lr)
            if ref_losses is None:
                ref_losses = losses
            row = dict(variant=v.name, grad_err=err, loss_first=losses[0], loss_last=losses[-1],
                       loss_rel=abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1]))
            if on_gpu:
                ms = time_us(lambda: _step(fn, model, data), device, warmup=3, iters=it)[0] / 1e3
                row.update(ms=ms, tokens_per_s=B * L / (ms * 1e-3),
                           peak_gib=_peak_extra_bytes(fn, model, data) / 2 ** 30)
            rows.append(row)
            print(f"  {v.name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as err:  # a variant that fails is reported; the others still run
            if not rows:
                raise
            failed[v.name] = f"FAIL: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(f"  {v.name}: {failed[v.name]}", flush=True)
        finally:
            if patch is not None:
                patch.revert()
    torch._dynamo.reset()
    if on_gpu:
        add_step_ratios(rows, "transformers eager", "transformers compiled")
        print_step_table(rows, steps, ("mem vs eager", "mem_vs_eager", "{:.2f}x"))
    else:
        for r in rows:
            print(f"  {r['variant']:<26} gradient error (worst parameter) {r['grad_err']:.1e}; loss after {steps} "
                  f"steps {r['loss_last']:.6f} (rel. to transformers eager {r['loss_rel']:.1e})")

    # bf16: RMSNorm / SwiGLU / the loss round differently from transformers (fp32: barely); fp8 more
    def tolerances(name):
        if "fp8" in name:
            return 0.5, 5e-2
        return (0.1, 2e-2) if on_gpu else (1e-3, 1e-4)

    ok = verify_step_rows(rows, failed, tolerances)
    return dict(config=dict(preset=preset, layers=layers, vision_depth=vision_depth, batch=B, seq=L, steps=steps,
                            lr=lr, dtype=str(dtype), fp8=fp8),
                rows=rows, all_verified=ok)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-layers", type=int, default=4, help="model: text decoder layers (default 4)")
    p.add_argument("--vision-depth", type=int, default=4, help="model: vision blocks (default 4)")
    p.add_argument("--model-batch", type=int, default=2, help="model: samples (default 2)")
    p.add_argument("--model-seq", type=int, default=4096, help="model: tokens a sample (default 4096)")
