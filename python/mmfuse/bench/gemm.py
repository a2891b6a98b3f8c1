"""``mmfuse-bench gemm``: the dual-expert GEMM against two cuBLAS calls (``torch.matmul``) in the same run,
for the forward GEMM and both backward GEMMs (dX, dW) of each shape, bf16 with fp32 accumulation, with the
bf16 GEMM ceiling (8192^3) of the same run. Shapes are ``m x k x n`` an expert (tokens x in x out).

Columns: mmfuse's time, TFLOP/s, ``% ideal`` = ``(F0 + F1) / R_big`` over our time, where ``R_big``
is cuBLAS's rate on the big problem alone, and the speedup over the two cuBLAS calls. The output is
checked against torch.matmul."""

import torch

import mmfuse

from .common import time_us

# (name, (m0, k0, n0), (m1, k1, n1))
_SHAPES = [
    ("large: 8192x2048x11008 + 1024x2048x2752", (8192, 2048, 11008), (1024, 2048, 2752)),
    ("tiny small: 1024x2048x11008 + 128x2048x2752", (1024, 2048, 11008), (128, 2048, 2752)),
    # a VLA layer: VL expert hidden 2048 / intermediate 11008, action expert hidden 1024 / intermediate 2048
    ("VLA gate_up: 8192x2048x22016 + 1024x1024x4096", (8192, 2048, 22016), (1024, 1024, 4096)),
    ("VLA down: 8192x11008x2048 + 1024x2048x1024", (8192, 11008, 2048), (1024, 2048, 1024)),
]
_CPU_SHAPES = [("cpu: 256x128x320 + 32x64x96", (256, 128, 320), (32, 64, 96))]


def _problems(shape, which, dt, device, g):
    """Operands (a, w), the layout and the reference of one expert's GEMM: fwd y = x W^T; dX = dY W;
    dW = dY^T x."""
    m, k, n = shape
    x = torch.randn(m, k, generator=g).to(device, dt)
    w = torch.randn(n, k, generator=g).to(device, dt) / k ** 0.5
    dy = torch.randn(m, n, generator=g).to(device, dt)
    if which == "fwd":
        return (x, w), (False, True), lambda: x @ w.t(), 2 * m * n * k
    if which == "dX":
        return (dy, w), (False, False), lambda: dy @ w, 2 * m * n * k
    return (dy, x), (True, False), lambda: dy.t() @ x, 2 * m * n * k


def _verify(outs, refs) -> str:
    worst = 0.0
    for o, r in zip(outs, refs):
        if o.numel():
            worst = max(worst, float((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)))
    return "close" if worst <= 2 ** -6 else f"FAIL {worst:.1e}"


def run(device: str, quick: bool = False) -> dict:
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    it = dict(iters=10 if quick else 30)
    out = {}
    if device == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=dt)
        b = torch.randn(8192, 8192, device=device, dtype=dt)
        t, _ = time_us(lambda: a @ b, device, **it)
        ceiling = 2 * 8192 ** 3 / (t * 1e-6) / 1e12
        del a, b
        print(f"\nbf16 GEMM ceiling (cuBLAS 8192^3): {ceiling:.0f} TFLOP/s")
        out["ceiling_tflops"] = ceiling
    shapes = _SHAPES if device == "cuda" else _CPU_SHAPES
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"\n## dual GEMM ({dt}; fp32 accumulate; baseline = two torch.matmul calls)")
    hdr = (f"| {'case':<46} | {'GEMM':<4} | {'mmfuse us':>9} | {'2x cuBLAS us':>12} | {'big alone us':>12} | "
           f"{'TFLOP/s':>7} | {'% ideal':>7} | {'speedup':>7} | verified |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for name, s0, s1 in shapes:
        for which in ("fwd", "dX", "dW"):
            (a0, w0), (ta, tb), ref0, f0 = _problems(s0, which, dt, device, g)
            (a1, w1), _, ref1, f1 = _problems(s1, which, dt, device, g)
            refs = (ref0(), ref1())
            ours = mmfuse.dual_gemm(a0, w0, a1, w1, ta, tb)
            verified = _verify(ours, refs)
            t_ours, _ = time_us(lambda: mmfuse.dual_gemm(a0, w0, a1, w1, ta, tb), device, **it)
            t_two, _ = time_us(lambda: (ref0(), ref1()), device, **it)
            t_big, _ = time_us(ref0, device, **it)
            ideal_us = t_big * (f0 + f1) / f0
            row = dict(case=name, gemm=which, us=t_ours, two_cublas_us=t_two, big_alone_us=t_big,
                       tflops=(f0 + f1) / (t_ours * 1e-6) / 1e12, pct_ideal=100 * ideal_us / t_ours,
                       speedup=t_two / t_ours, verified=verified)
            rows.append(row)
            print(f"| {name:<46} | {which:<4} | {t_ours:9.1f} | {t_two:12.1f} | {t_big:12.1f} | {row['tflops']:7.0f} | "
                  f"{row['pct_ideal']:7.1f} | {row['speedup']:6.2f}x | {verified:<8} |")
            del a0, w0, a1, w1, ours, refs
    out["rows"] = rows
    out["all_verified"] = all(not r["verified"].startswith("FAIL") for r in rows)
    if rows:
        print(f"\ndual GEMM: worst % of ideal {min(r['pct_ideal'] for r in rows):.1f}, worst speedup "
              f"vs two cuBLAS {min(r['speedup'] for r in rows):.2f}x")
    return out
