"""``mmfuse-bench swiglu``: SwiGLU on the fused gate/up layout at the VLA experts' shapes (bf16; the
vision-language expert's 15360 x 11008 and the action expert's 1024 x 2048), forward and backward,
against ``F.silu(gate) * up`` in eager PyTorch and under torch.compile, with the copy ceiling of the
same run. Bytes: forward reads gate_up, writes y; backward reads gate_up and dy, writes d_gate_up (and,
as the expert block asks, y again)."""

import torch
import torch.nn.functional as F

import mmfuse
from mmfuse.swiglu import swiglu_backward

from .common import Row, run_bandwidth_family, time_us


def _torch(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def _rows(T, inter, device, quick):
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(inter)
    gu = 3 * torch.randn(T, 2 * inter, device=device, dtype=dt, generator=g)
    dy = torch.randn(T, inter, device=device, dtype=dt, generator=g)
    it = dict(iters=10 if quick else 30)
    es = gu.element_size()
    fwd_bytes = 3 * T * inter * es
    bwd_bytes = 6 * T * inter * es  # gate_up, dy in; d_gate_up, y out
    compiled = torch.compile(_torch)
    y = mmfuse.swiglu(gu)
    want = _torch(gu.float()).to(dt)
    verdict = "close" if bool(((y.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-6).all()) \
        else "FAIL"

    def fb(fn):
        x = gu.detach().requires_grad_()
        return lambda: torch.autograd.grad(fn(x), x, dy)

    tag = f"T{T} I{inter}"
    rows = []
    t_e, s_e = time_us(lambda: _torch(gu), device, **it)
    t_c, s_c = time_us(lambda: compiled(gu), device, **it)
    t_o, s_o = time_us(lambda: mmfuse.swiglu(gu), device, **it)
    rows += [Row(f"{tag} fwd  eager", t_e, s_e, fwd_bytes), Row(f"{tag} fwd  torch.compile", t_c, s_c, fwd_bytes),
             Row(f"{tag} fwd  mmfuse", t_o, s_o, fwd_bytes, t_c, "vs compile", verdict)]
    t_o, s_o = time_us(lambda: swiglu_backward(dy, gu, True), device, **it)
    rows.append(Row(f"{tag} bwd  mmfuse (kernel, y recomputed)", t_o, s_o, bwd_bytes, verified=verdict))
    t_e, s_e = time_us(fb(_torch), device, **it)
    t_c, s_c = time_us(fb(compiled), device, **it)
    t_o, s_o = time_us(fb(mmfuse.swiglu), device, **it)
    fb_bytes = fwd_bytes + 5 * T * inter * es
    rows += [Row(f"{tag} f+b  eager", t_e, s_e, fb_bytes), Row(f"{tag} f+b  torch.compile", t_c, s_c, fb_bytes),
             Row(f"{tag} f+b  mmfuse", t_o, s_o, fb_bytes, t_c, "vs compile", verdict)]
    return rows


def run(device: str, quick: bool = False) -> dict:
    shapes = [(15360, 11008), (1024, 2048)] if device == "cuda" else [(64, 48)]
    return run_bandwidth_family("swiglu", "swiglu (bf16, fused gate/up; speedup = torch.compile time / mmfuse time)", shapes, _rows, device, quick)
