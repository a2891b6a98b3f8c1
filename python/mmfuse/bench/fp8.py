"""``mmfuse-bench fp8``: the fp8 linear layer against bf16 ``F.linear`` and against fp8 built from PyTorch
pieces (amax, scale, saturating cast, ``torch._scaled_mm``; eager and ``torch.compile``), forward and
forward+backward, at the shapes of PERFORMANCE.md (``M x K x N`` = tokens x in x out), plus the quantize
pass's effective bandwidth against the copy ceiling, all in one run.

Rows: ``mmfuse`` = ``Fp8Linear(fallback=False, scaling="dynamic")``, w quantized on every call;
``mmfuse cached-w`` = the micro-batch case (w's fp8 copies reused, x scaled by its delayed history);
``delayed`` = delayed scaling of x and the gradient (one pass each; the module's default), w quantized
(dynamically) on every call; ``auto`` = ``Fp8Linear`` as shipped (delayed scaling; bf16 below the
measured :func:`mmfuse.fp8.fp8_pays` threshold);
``row`` = the per-row recipe.
``share`` = time / bf16 time (issue 6's targets for fwd+bwd: <= 0.58, 0.62, 0.66 on the three big
shapes, <= 1.00 at 2048x1024x1024 and below). ``launches`` = kernels of one forward (target <= 3)."""

import torch
import torch.nn.functional as F

from .. import fp8
from ..nn import Fp8Linear
from .common import copy_bandwidth_gbs, time_us

_SHAPES = [(16384, 8192, 8192), (8192, 4096, 14336), (8192, 4096, 4096), (8192, 8192, 8192), (16384, 2048, 11008),
           (4096, 4096, 4096), (4096, 2048, 2048), (2048, 1024, 1024), (1024, 1024, 1024)]
_QUICK_SHAPES = [(16384, 8192, 8192), (8192, 4096, 14336), (8192, 4096, 4096), (2048, 1024, 1024)]
_CPU_SHAPES = [(256, 192, 320)]
_BREAKDOWN = {(16384, 8192, 8192), (8192, 4096, 14336), (8192, 4096, 4096)}


class _TorchFp8(torch.autograd.Function):
    """fp8 linear from PyTorch pieces (tensorwise dynamic scaling), the way a user would write it."""

    @staticmethod
    def _q(t, dtype):
        fmax = torch.finfo(dtype).max
        scale = fmax / t.abs().amax().float().clamp_min(1e-12)
        return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()

    @staticmethod
    def forward(ctx, x, w, b):
        xq, xs = _TorchFp8._q(x, torch.float8_e4m3fn)
        wq, ws = _TorchFp8._q(w, torch.float8_e4m3fn)
        ctx.save_for_backward(xq, xs, wq, ws)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=b, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    @staticmethod
    def backward(ctx, g):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = _TorchFp8._q(g, torch.float8_e5m2)
        dx = torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16)
        dw = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), scale_a=gs, scale_b=xs,
                              out_dtype=torch.bfloat16)
        return dx, dw, g.sum(0)


def _kernel_times(fn) -> list:
    """(name, device µs) of each CUDA kernel (and memset / copy) one call of fn runs, in launch order,
    from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    return name.split("<")[0].split("(")[0].replace("void ", "")[:40]


def _rel(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))


def run(device: str, quick: bool = False) -> dict:
    it = dict(iters=8 if quick else 20, warmup=3)
    out = {"rows": []}
    on_gpu = device == "cuda"
    if on_gpu:
        copy = copy_bandwidth_gbs(device)
        print(f"\ncopy ceiling: {copy:.0f} GB/s")
        out["copy_gbs"] = copy
    shapes = (_QUICK_SHAPES if quick else _SHAPES) if on_gpu else _CPU_SHAPES
    g = torch.Generator().manual_seed(0)
    compiled_fwd = torch.compile(lambda x, w, b: _TorchFp8.apply(x, w, b))

    def compiled_step(x, w, b, gy):
        _TorchFp8.apply(x, w, b).backward(gy)

    compiled_fb = torch.compile(compiled_step)
    print(f"\n## fp8 linear ({'bf16 in/out, fp32 accumulate' if on_gpu else 'CPU emulation'}; M x K x N; "
          "share = time / bf16 F.linear time)")
    hdr = (f"| {'shape':<18} | {'pass':<7} | {'bf16 us':>9} | {'mmfuse us':>9} | {'share':>5} | {'cached-w':>8} | "
           f"{'delayed':>7} | {'auto':>5} | {'row':>5} | {'torch fp8 eager':>15} | {'compiled':>8} | {'launches':>8} | "
           f"{'rel err':>7} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for (m, k, n) in shapes:
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, torch.bfloat16)
        b = torch.randn(n, generator=g).to(device, torch.bfloat16)
        gy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
        lin = Fp8Linear(k, n, device=device, dtype=torch.bfloat16, fallback=False, scaling="dynamic")
        auto = Fp8Linear(k, n, device=device, dtype=torch.bfloat16)
        cached = Fp8Linear(k, n, device=device, dtype=torch.bfloat16, fallback=False, scaling="delayed")
        rowm = Fp8Linear(k, n, device=device, dtype=torch.bfloat16, fallback=False, recipe="row")
        dela = Fp8Linear(k, n, device=device, dtype=torch.bfloat16, fallback=False, scaling="delayed")
        with torch.no_grad():
            for mod in (lin, auto, cached, rowm, dela):
                mod.weight.copy_(w)
                mod.bias.copy_(b)
        xg = x.detach().requires_grad_()
        ref = F.linear(x.double() if not on_gpu else x.float(), w.float() if on_gpu else w.double(),
                       b.float() if on_gpu else b.double())
        err = _rel(lin(x), ref)
        verified = "close" if err <= 0.045 else f"FAIL {err:.3f}"
        cached(x, is_first_microbatch=True)  # fills the cache and the history
        shape = f"{m}x{k}x{n}"
        names = [nm for nm, _ in _kernel_times(lambda: lin(x))] if on_gpu else []
        launches = len(names)
        if on_gpu and (m, k, n) == shapes[0]:
            print("forward kernels: " + "; ".join(nm[:60] for nm in names))

        def fb(f):
            def step():
                for p in (xg, lin.weight, lin.bias, auto.weight, auto.bias, cached.weight, cached.bias, rowm.weight,
                          rowm.bias, dela.weight, dela.bias, w, b):
                    p.grad = None
                f(xg).backward(gy)
            return step

        wp, bp = w.detach().requires_grad_(), b.detach().requires_grad_()
        time_us(fb(lambda v: F.linear(v, wp, bp)), device, **it)  # the first backward starts autograd's thread
        for pas in ("fwd", "fwd+bwd"):
            if pas == "fwd":
                # the training forward: w requires grad, so each op keeps what its backward needs
                fns = dict(bf16=lambda: F.linear(x, wp, bp), ours=lambda: lin(x),
                           cached=lambda: cached(x, is_first_microbatch=False), delayed=lambda: dela(x),
                           auto=lambda: auto(x), row=lambda: rowm(x),
                           torch_eager=lambda: _TorchFp8.apply(x, wp, bp), torch_comp=lambda: compiled_fwd(x, wp, bp))
                t = {k_: time_us(f, device, **it)[0] for k_, f in fns.items()} if on_gpu else \
                    {"bf16": time_us(fns["bf16"], device, **it)[0], "ours": time_us(fns["ours"], device, **it)[0]}
            else:
                fns = dict(bf16=fb(lambda v: F.linear(v, wp, bp)), ours=fb(lin), cached=fb(lambda v: cached(v, False)),
                           delayed=fb(dela), auto=fb(auto), row=fb(rowm),
                           torch_eager=fb(lambda v: _TorchFp8.apply(v, wp, bp)),
                           torch_comp=lambda: (setattr(xg, "grad", None), compiled_fb(xg, wp, bp, gy)))
                t = {k_: time_us(f, device, **it)[0] for k_, f in fns.items()} if on_gpu else \
                    {"bf16": time_us(fns["bf16"], device, **it)[0], "ours": time_us(fns["ours"], device, **it)[0]}
            sh = {k_: v / t["bf16"] for k_, v in t.items()}
            row = dict(shape=shape, pass_=pas, bf16_us=t["bf16"], us=t["ours"], share=sh["ours"],
                       cached_share=sh.get("cached"), delayed_share=sh.get("delayed"), auto_share=sh.get("auto"),
                       row_share=sh.get("row"),
                       torch_eager_share=sh.get("torch_eager"), torch_compiled_share=sh.get("torch_comp"),
                       launches=launches if pas == "fwd" else None, rel_err=err, verified=verified)
            out["rows"].append(row)
            f2 = lambda v: f"{v:5.2f}" if v is not None else "    -"  # noqa: E731
            print(f"| {shape:<18} | {pas:<7} | {t['bf16']:9.1f} | {t['ours']:9.1f} | {sh['ours']:5.2f} | "
                  f"{f2(sh.get('cached')):>8} | {f2(sh.get('delayed')):>7} | {f2(sh.get('auto'))} | {f2(sh.get('row'))} | "
                  f"{f2(sh.get('torch_eager')):>15} | "
                  f"{f2(sh.get('torch_comp')):>8} | {(launches if pas == 'fwd' else ''):>8} | {err:7.4f} |")
        if on_gpu and (m, k, n) in _BREAKDOWN:
            # where the fwd+bwd time goes: each kernel of one step, ours (delayed) against bf16
            for label, f in (("delayed", fb(dela)), ("bf16", fb(lambda v: F.linear(v, wp, bp)))):
                ks = _kernel_times(f)
                total = sum(us for _, us in ks)
                out.setdefault("breakdown", []).append(dict(shape=shape, what=label, kernels=ks))
                print(f"  {shape} fwd+bwd {label} kernels ({total:.0f} us of device time): " +
                      "; ".join(f"{_short(nm)} {us:.0f}" for nm, us in ks))
        del x, w, b, gy, xg, lin, auto, cached, dela, wp, bp
    if on_gpu:
        # quantize: bf16 -> e4m3 row-major + transposed; bytes = x read once + both copies written
        x = torch.randn(16384, 8192, device=device).to(torch.bfloat16)
        nbytes = x.numel() * 4
        st = fp8.new_state(16, device)
        ref = fp8.fp8_quantize(x, st, transposed=True)  # the same amax every call: every cast is this one
        qrows = []
        for mode, dyn in (("dynamic (2 passes)", True), ("delayed (1 pass)", False)):
            q = fp8.fp8_quantize(x, st, transposed=True, dynamic=dyn)
            ok = torch.equal(q.q.view(torch.uint8), ref.q.view(torch.uint8)) and \
                torch.equal(q.qt.view(torch.uint8), ref.qt.view(torch.uint8))
            tq, _ = time_us(lambda: fp8.fp8_quantize(x, st, transposed=True, dynamic=dyn), device, **it)
            gbs = nbytes / (tq * 1e-6) / 1e9
            qrows.append(dict(mode=mode, us=tq, gbs=gbs, pct_copy=100 * gbs / copy, verified=ok))
            print(f"quantize 16384x8192 bf16 -> e4m3 + transposed, {mode}: {tq:.1f} us, {gbs:.0f} GB/s effective "
                  f"({100 * gbs / copy:.1f} % of copy; target 3500 GB/s; {'bitwise' if ok else 'MISMATCH'})")
        # fp8_transpose: the transposed copy from the row-major one (bytes read once, written once)
        tt, _ = time_us(lambda: torch.ops.mmfuse.fp8_transpose(ref.q), device, **it)
        ok = torch.equal(torch.ops.mmfuse.fp8_transpose(ref.q).view(torch.uint8), ref.qt.view(torch.uint8))
        gbs = 2 * ref.q.numel() / (tt * 1e-6) / 1e9
        qrows.append(dict(mode="transpose", case="fp8_transpose 16384x8192 e4m3", us=tt, gbs=gbs,
                          pct_copy=100 * gbs / copy, verified=ok))
        print(f"fp8_transpose 16384x8192: {tt:.1f} us, {gbs:.0f} GB/s ({100 * gbs / copy:.1f} % of copy; "
              f"{'bitwise' if ok else 'MISMATCH'})")
        del x, ref
        # the SwiGLU gradient cast from dy and the gate/up pack, row-major copy alone (the fp8 expert's first
        # copy at the 3B VL shapes): dy and the pack read once, the e5m2 copy written
        from ..swiglu import swiglu_backward_fp8, swiglu_pack_fp8
        T, inter = 15360, 11008
        q8, si8 = swiglu_pack_fp8(torch.randn(T, 2 * inter, device=device).to(torch.bfloat16))
        dy = torch.randn(T, inter, device=device).to(torch.bfloat16)
        want = torch.ops.mmfuse.fp8_quantize(swiglu_backward_fp8(dy, q8, si8, False)[0], fp8.new_state(16, device),
                                             True, False, True, True, False)
        got = torch.ops.mmfuse.fp8_quantize(dy, fp8.new_state(16, device), True, False, True, True, False, q8, si8)
        ok = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[2], want[2])
        gst = fp8.new_state(16, device)
        tg, _ = time_us(lambda: torch.ops.mmfuse.fp8_quantize(dy, gst, True, False, True, False, False, q8, si8),
                        device, **it)
        gbs = (dy.numel() * 2 + q8.numel() + si8.numel() * 4 + 2 * dy.numel()) / (tg * 1e-6) / 1e9
        qrows.append(dict(mode="swiglu_grad", case=f"SwiGLU gradient cast from the pack {T}x{2 * inter}, q alone, "
                          "delayed", us=tg, gbs=gbs, pct_copy=100 * gbs / copy, verified=ok))
        print(f"SwiGLU gradient cast from the pack {T}x{2 * inter} (q alone, delayed): {tg:.1f} us, {gbs:.0f} GB/s "
              f"({100 * gbs / copy:.1f} % of copy; {'bitwise' if ok else 'MISMATCH'})")
        out["quantize"] = qrows
    targets = {"16384x8192x8192": 0.58, "8192x4096x14336": 0.62, "8192x4096x4096": 0.66, "2048x1024x1024": 1.00}
    got = [(r["shape"], r["share"], r["cached_share"], r["delayed_share"], r["auto_share"]) for r in out["rows"]
           if r["pass_"] == "fwd+bwd" and r["shape"] in targets]
    if got and on_gpu:
        print("fp8: fwd+bwd share of bf16 (target), the default (delayed) scaling: " + "; ".join(
            f"{s} {d:.2f} ({targets[s]:.2f}; dynamic {v:.2f}; cached-w {c:.2f})" if targets[s] < 1 else
            f"{s} auto {a:.2f} ({targets[s]:.2f}, the bf16 fallback)" for s, v, c, d, a in got))
    out["all_verified"] = all(not r["verified"].startswith("FAIL") for r in out["rows"])
    return out
