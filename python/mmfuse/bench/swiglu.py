"""``mmfuse-bench swiglu``: SwiGLU on the fused gate/up layout at the VLA experts' shapes (bf16; the
vision-language expert's 15360 x 11008 and the action expert's 1024 x 2048), forward and backward,
against ``F.silu(gate) * up`` in eager PyTorch and under torch.compile, with the copy ceiling of the
same run. Bytes: forward reads gate_up, writes y; backward reads gate_up and dy, writes d_gate_up (and,
as the expert block asks, y again). The fp8 expert's pair: ``swiglu_pack_fp8`` (reads gate_up, writes its
e4m3 bytes and tile scales) and ``swiglu_backward_fp8`` (reads those and dy, writes d_gate_up)."""

import torch
import torch.nn.functional as F

import mmfuse
from mmfuse.swiglu import PACK_TILE, swiglu_backward, swiglu_backward_fp8, swiglu_pack_fp8

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
    q, si = swiglu_pack_fp8(gu)
    unpacked = q.float() * si.repeat_interleave(PACK_TILE, dim=1)[:, :2 * inter]
    packed_ok = bool(((unpacked - gu.float()).abs() <= gu.float().abs() / 16 + si.max() / 1024).all()) and \
        torch.equal(swiglu_backward_fp8(dy, q, si, False)[0], swiglu_backward(dy, unpacked.to(dt), False)[0])
    pack_bytes = T * 2 * inter * (es + 1) + si.numel() * 4
    t_o, s_o = time_us(lambda: swiglu_pack_fp8(gu), device, **it)
    rows.append(Row(f"{tag} pack mmfuse swiglu_pack_fp8", t_o, s_o, pack_bytes,
                    verified="close" if packed_ok else "FAIL"))
    t_o, s_o = time_us(lambda: swiglu_backward_fp8(dy, q, si, False), device, **it)
    bwd8_bytes = T * 2 * inter * (1 + es) + si.numel() * 4 + T * inter * es
    rows.append(Row(f"{tag} bwd  mmfuse from fp8 (kernel)", t_o, s_o, bwd8_bytes,
                    verified="close" if packed_ok else "FAIL"))
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
