"""``mmfuse-bench train``: the training step of a VLA mixture-of-transformers decoder stack, the PyTorch
reference (``vla_reference.py``, HF-style) against the same model on mmfuse (``mmfuse.nn.vla``, the same
weights), eager and ``torch.compile``, in one run.

Columns: ms a step (forward + backward of the regression loss, gradients set to None first, as a
training loop does), tokens/s, the speedup over each PyTorch variant, the peak memory a step adds to
what the weights and the batch hold (its gradients included), the time as a multiple of the
**bound** (the step's own GEMMs and attention kernels alone, back to back at its shapes, measured in
the same run), and
agreement with PyTorch eager: the largest relative gradient error of a parameter group at the first
step, and the loss after ``--steps`` AdamW steps from the same weights on the same batch.

``--fp8`` adds the mmfuse model with fp8 projections and experts (against its own bound: its fp8 GEMMs
as ``torch._scaled_mm`` of pre-quantized operands), and, where torchao is installed, the reference
compiled with torchao's float8 training on the same layers.

On the CPU: the ``tiny`` preset in fp32, eager only, agreement only (CPU timings say nothing about
the GPU)."""

import argparse
import math
import time
from typing import Callable, Dict, List, Optional

import torch

from ..nn.vla import VLADecoder
from .common import add_step_ratios, print_step_table, time_us, time_us_interleaved, verify_step_rows
from .vla_reference import Batch, VLAConfig, VLAReference, init_weights, make_batch, preset, type_indices


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


class _Variant:
    """One model of the comparison: its forward on the batch and its parameters."""

    def __init__(self, name: str, model: torch.nn.Module, forward: Callable[[], torch.Tensor], grads):
        self.name, self.model, self.forward, self.grads = name, model, forward, grads

    def step(self, target) -> torch.Tensor:
        for p in self.model.parameters():
            p.grad = None
        loss = _loss(self.forward(), target)
        loss.backward()
        return loss


def _variants(cfg: VLAConfig, batch: Batch, device, dtype, compiled: bool, fp8: bool,
              fp8_grad=torch.float8_e5m2, fp8_scaling: str = "delayed") -> List[_Variant]:
    ref = VLAReference(cfg)
    init_weights(ref, seed=0)
    ref = ref.to(device, dtype)
    idx_vl, idx_act = type_indices(batch)
    ours = VLADecoder(cfg, device=device, dtype=dtype)
    ours.load_reference(ref.state_dict())
    ref_grads = lambda m: {n: p.grad for n, p in m.named_parameters()}  # noqa: E731
    out = [_Variant("PyTorch eager", ref, lambda: ref(batch.embeds, batch.positions, idx_vl, idx_act),
                    lambda: ref_grads(ref))]
    if compiled:
        ref_c = torch.compile(ref)
        out.append(_Variant("PyTorch compiled", ref, lambda: ref_c(batch.embeds, batch.positions, idx_vl, idx_act),
                            lambda: ref_grads(ref)))
    out.append(_Variant("mmfuse eager", ours, lambda: ours(batch.embeds, batch.positions, batch.action),
                        ours.reference_grads))
    if compiled:
        ours_c = torch.compile(ours)
        out.append(_Variant("mmfuse compiled", ours, lambda: ours_c(batch.embeds, batch.positions, batch.action),
                            ours.reference_grads))
    if fp8:
        ours8 = VLADecoder(cfg, fp8=True, fp8_grad_dtype=fp8_grad, fp8_scaling=fp8_scaling, device=device, dtype=dtype)
        ours8.load_reference(ref.state_dict())
        out.append(_Variant("mmfuse eager fp8", ours8, lambda: ours8(batch.embeds, batch.positions, batch.action),
                            ours8.reference_grads))
        if compiled:
            ours8_c = torch.compile(ours8)
            out.append(_Variant("mmfuse compiled fp8", ours8,
                                lambda: ours8_c(batch.embeds, batch.positions, batch.action), ours8.reference_grads))
        peer = _torchao_fp8(cfg, ref, device, dtype) if compiled else None
        if peer is not None:
            peer_c = torch.compile(peer)
            out.append(_Variant("torchao fp8 compiled", peer, lambda: peer_c(batch.embeds, batch.positions, idx_vl,
                                                                             idx_act), lambda: ref_grads(peer)))
    return out


def _torchao_fp8(cfg: VLAConfig, ref: torch.nn.Module, device, dtype) -> Optional[torch.nn.Module]:
    """The reference with torchao's float8 training (tensorwise dynamic scaling) on the layers the mmfuse
    fp8 model runs in fp8 (q/k/v, o, the vision-language expert): the peer a user has, optional (None
    when torchao is not installed)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    peer = VLAReference(cfg).to(device, dtype)
    peer.load_state_dict(ref.state_dict())
    keys = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.vl.")
    convert_to_float8_training(peer, module_filter_fn=lambda mod, fqn: any(k in fqn for k in keys))
    return peer


def _group(name: str) -> str:
    """A parameter's group: the norms, q/k/v, o, each expert, the final norm."""
    if name == "norm.weight":
        return "final norm"
    for key, group in (("layernorm", "norms"), ("q_proj", "q/k/v"), ("k_proj", "q/k/v"), ("v_proj", "q/k/v"),
                       ("o_proj", "o"), ("mlp.vl.", "VL expert"), ("mlp.action.", "action expert")):
        if key in name:
            return group
    return name


def _grad_errors(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """||got - ref|| / ||ref|| of each parameter group (fp64 sums)."""
    num: Dict[str, float] = {}
    den: Dict[str, float] = {}
    for name, r in ref.items():
        g = got[name]
        k = _group(name)
        num[k] = num.get(k, 0.0) + float((g.double() - r.double()).pow(2).sum())
        den[k] = den.get(k, 0.0) + float(r.double().pow(2).sum())
    return {k: math.sqrt(num[k] / max(den[k], 1e-300)) for k in num}


def _train_losses(v: _Variant, target, steps: int, lr: float) -> List[float]:
    """The loss at every step of `steps` AdamW steps from the variant's current weights (restored after)."""
    saved = {n: p.detach().clone() for n, p in v.model.named_parameters()}
    opt = torch.optim.AdamW(v.model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        losses.append(float(v.step(target).detach()))
        opt.step()
    with torch.no_grad():
        for n, p in v.model.named_parameters():
            p.copy_(saved[n])
            p.grad = None
    return losses


def _bound_layer(cfg: VLAConfig, batch: Batch, device, fp8: bool = False) -> Callable[[], None]:
    """One layer of the step's GEMMs (forward, dX and dW of every projection and expert) and attention
    (SDPA forward and backward) back to back at its shapes, with nothing between them (the bound is
    its time x layers). With ``fp8`` the GEMMs that the fp8 model runs in fp8 (q/k/v, o and every expert
    whose gate/up GEMM is big enough: mmfuse.fp8.fp8_pays) are torch._scaled_mm of pre-quantized
    operands (e4m3, the gradient e5m2), the rest bf16."""
    from .. import fp8 as _fp8

    B, L = batch.shape
    T, A = B * L, batch.action
    T0, T1 = B * (L - A), B * A
    h, d = cfg.hidden, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16, generator=g)  # noqa: E731
    one = torch.ones((), device=device)
    mm8 = lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    expert_fp8 = [_fp8.fp8_pays(T0, 2 * cfg.inter_vl, h), _fp8.fp8_pays(T1, 2 * cfg.inter_action, h)]
    # (m, k, n, in fp8) of each forward GEMM y [m, n] = x [m, k] @ w^T
    gemms = [(T, h, (cfg.heads + 2 * cfg.kv_heads) * d, _fp8.fp8_pays(T, (cfg.heads + 2 * cfg.kv_heads) * d, h)),
             (T, cfg.heads * d, h, _fp8.fp8_pays(T, h, cfg.heads * d)),
             (T0, h, 2 * cfg.inter_vl, expert_fp8[0]), (T1, h, 2 * cfg.inter_action, expert_fp8[1]),
             (T0, cfg.inter_vl, h, expert_fp8[0]), (T1, cfg.inter_action, h, expert_fp8[1])]
    ops = []
    for m, k, n, in_fp8 in gemms:
        x, w, dy = rnd(m, k), rnd(n, k), rnd(m, n)
        if fp8 and in_fp8:  # the second operand column-major, as the fp8 tensor cores take it
            xq, wq, dyq = x.to(e4), w.to(e4), dy.to(e5)
            wtq, dytq, xtq = w.t().contiguous().to(e4), dy.t().contiguous().to(e5), x.t().contiguous().to(e4)
            ops += [lambda a=xq, b=wq: mm8(a, b.t()), lambda a=dyq, b=wtq: mm8(a, b.t()),
                    lambda a=dytq, b=xtq: mm8(a, b.t())]
        else:
            ops += [lambda x=x, w=w: x @ w.t(), lambda dy=dy, w=w: dy @ w, lambda dy=dy, x=x: dy.t() @ x]
    q = rnd(B, cfg.heads, L, d).requires_grad_()
    k = rnd(B, cfg.kv_heads, L, d).requires_grad_()
    v = rnd(B, cfg.kv_heads, L, d).requires_grad_()
    do = rnd(B, cfg.heads, L, d)

    def attention():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)

    ops.append(attention)

    def layer():
        for op in ops:
            op()
    return layer


def _expert_block_ms(cfg: VLAConfig, batch: Batch, device, iters: int) -> dict:
    """One layer's expert block alone (MoTExperts, forward + backward) at the step's shapes, bf16 (one
    dual GEMM a projection) and fp8 (the vision-language expert through _Fp8ExpertFn, the action expert
    bf16 where fp8 does not pay): the issue's fp8 / bf16 time share of the experts."""
    from ..nn.vla import MoTExperts

    B, L = batch.shape
    T, m0 = B * L, B * (L - batch.action)
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(T, cfg.hidden, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(T, cfg.hidden, device=device, dtype=torch.bfloat16, generator=g)
    out = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        e = MoTExperts(cfg.hidden, (cfg.inter_vl, cfg.inter_action), fp8=fp8, device=device, dtype=torch.bfloat16)
        for p in e.parameters():
            torch.nn.init.normal_(p, std=cfg.hidden ** -0.5)

        def step(e=e):
            torch.autograd.backward(e(x, m0), dy)
        out[name] = time_us(step, device, warmup=3, iters=iters)[0] / 1e3
    return dict(bf16_ms=out["bf16"], fp8_ms=out["fp8"], fp8_share=out["fp8"] / out["bf16"])


def _peak_extra_bytes(v: _Variant, target, device) -> int:
    for p in v.model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    v.step(target)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run(device: str, *, preset_name: str = "3b", layers: Optional[int] = None, batch: int = 4, seq: int = 4096,
        action: int = 256, steps: int = 50, lr: float = 1e-4, fp8: bool = False, compile: bool = True,
        quick: bool = False, fp8_grad: str = "e5m2", fp8_scaling: str = "delayed") -> dict:
    on_gpu = device == "cuda"
    if not on_gpu:
        preset_name, batch, seq, action, steps = "tiny", 2, 48, 12, min(steps, 5)
    cfg = preset(preset_name, layers=layers)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    data = make_batch(cfg, batch, seq, action, device, dtype, seed=0)
    B, L = data.shape
    print(f"\n## train: VLA MoT decoder, preset {preset_name} ({cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/"
          f"{cfg.kv_heads} heads, experts {cfg.inter_vl} / {cfg.inter_action}), batch {B} x {L}, {action} action "
          f"tokens a sample, {str(dtype).replace('torch.', '')}", flush=True)
    grad_dtype = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}[fp8_grad]
    variants = _variants(cfg, data, device, dtype, compiled=on_gpu and compile, fp8=fp8 and on_gpu, fp8_grad=grad_dtype,
                         fp8_scaling=fp8_scaling)
    # agreement first, from the initial weights: gradients, then the losses of a short training run
    first = variants[0]
    first.step(data.target)
    ref_grads = {n: g.detach().clone() for n, g in first.grads().items()}
    rows = []
    ref_losses = None
    failed = {}
    for v in list(variants):
        t0 = time.perf_counter()
        try:
            v.step(data.target)
            errs = _grad_errors(ref_grads, v.grads())
            losses = _train_losses(v, data.target, steps, lr)
        except Exception as err:  # a variant that fails is reported as failed; the others still run
            if v is first:
                raise
            failed[v.name] = f"FAIL: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(f"  {v.name}: {failed[v.name]}", flush=True)
            variants.remove(v)
            continue
        if ref_losses is None:
            ref_losses = losses
        rows.append(dict(variant=v.name, grad_err=max(errs.values()), grad_errs=errs, loss_first=losses[0],
                         loss_last=losses[-1], loss_rel=abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1]),
                         losses=losses,
                         agreement_s=time.perf_counter() - t0))
        print(f"  {v.name}: agreement checked ({rows[-1]['agreement_s']:.0f} s)", flush=True)
    bound = bound8 = experts = None
    if on_gpu:
        it = dict(iters=5 if quick else 20)
        # the bound layers and every variant's step sampled in turn, so that their ratios hold
        bounds = [_bound_layer(cfg, data, device)] + ([_bound_layer(cfg, data, device, fp8=True)] if fp8 else [])
        steps_ = [lambda v=v: v.step(data.target) for v in variants]
        timed = time_us_interleaved(bounds + steps_, device, warmup=3, rounds=it["iters"])
        bound = timed[0][0] * cfg.layers / 1e3
        bound8 = timed[1][0] * cfg.layers / 1e3 if fp8 else None
        del bounds
        for v, row, (us, spread) in zip(variants, rows, timed[len(timed) - len(variants):]):
            ms = us / 1e3
            row.update(ms=ms, spread_ms=spread / 1e3, tokens_per_s=B * L / (ms * 1e-3),
                       peak_gib=_peak_extra_bytes(v, data.target, device) / 2 ** 30,
                       x_bound=ms / (bound8 if "fp8" in v.name else bound))
        print("  timed (every variant and the bound, in turn)", flush=True)
        add_step_ratios(rows, "PyTorch eager", "PyTorch compiled")
        experts = _expert_block_ms(cfg, data, device, it["iters"]) if fp8 else None
        first = [(label, b, B * L / (b * 1e-3), 1.0) for label, b in (("bound (GEMMs + attn)", bound),
                                                                      ("bound, fp8 GEMMs", bound8)) if b is not None]
        print_step_table(rows, steps, ("x bound", "x_bound", "{:.2f}"), first)
        print("spread of the timed rounds (max - min): " +
              ", ".join(f"{r['variant']} {r['spread_ms']:.2f} ms" for r in rows))
        if experts:
            print(f"\nexpert block of one layer, forward + backward: bf16 {experts['bf16_ms']:.2f} ms, fp8 "
                  f"{experts['fp8_ms']:.2f} ms ({experts['fp8_share']:.2f} of bf16)")
    else:
        for r in rows:
            print(f"  {r['variant']:<18} gradient error (worst group) {r['grad_err']:.1e}; loss after {steps} steps "
                  f"{r['loss_last']:.6f} (rel. to PyTorch eager {r['loss_rel']:.1e})")
    # agreement: bf16 kernels round differently from PyTorch's, fp32 ones barely; fp8 has 3 mantissa bits,
    # and its loss after 50 steps on one batch moves by several % between runs of the same fp8 math
    # (eager against compiled): the check catches a broken path; the loss itself is reported
    def tolerances(name):
        if "fp8" in name:
            return 0.3, 0.1
        return (5e-2, 1e-2) if on_gpu else (1e-4, 1e-5)

    ok = verify_step_rows(rows, failed, tolerances)
    return dict(config=dict(preset=preset_name, layers=cfg.layers, batch=B, seq=L, action=action, steps=steps, lr=lr,
                            dtype=str(dtype), fp8=fp8, fp8_grad=fp8_grad, fp8_scaling=fp8_scaling),
                bound_ms=bound, bound_fp8_ms=bound8 if on_gpu else None, expert_block=experts,
                rows=rows, all_verified=ok)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="3b", help="3b (default), 7b or tiny")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's, 4)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096, help="tokens a sample")
    p.add_argument("--action", type=int, default=256, help="action tokens a sample (its last ones)")
    p.add_argument("--steps", type=int, default=50, help="AdamW steps of the loss agreement check")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-compile", action="store_true", help="eager variants only")
    p.add_argument("--fp8-grad", choices=("e5m2", "e4m3"), default="e5m2",
                   help="the fp8 model's output-gradient format (default e5m2)")
    p.add_argument("--fp8-scaling", choices=("delayed", "dynamic"), default="delayed",
                   help="the fp8 model's activation and gradient scaling (default delayed)")
    p.add_argument("--fp8", action="store_true",
                   help="also the mmfuse model with its projections and experts in fp8 where it pays (GPU)")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel ranks: FSDP2 with activation checkpointing, gradients checked against one "
                        "process (gloo processes on the CPU; on GPUs run under torchrun --nproc-per-node N)")
