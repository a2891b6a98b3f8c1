"""``mmfuse-bench rms_norm``: residual add + RMSNorm at the VLA step's shapes (bf16; T = 16384 tokens of
hidden 2048 and 3584), forward and backward, against HF's code in eager PyTorch and under
torch.compile, with the copy ceiling of the same run. Bytes: forward reads x and the residual, writes
the normalized rows and h; backward reads dout, dh and h, writes dx (and the weight gradient). The
backward kernel runs on each of its row paths (MMFUSE_RMS_NORM_BWD) and is checked against HF's
autograd in float64."""

import torch

import mmfuse

from .common import Row, path_override, run_bandwidth_family, time_us


def _hf(x, res, w, eps=1e-6):
    h = res + x
    hs = h.float()
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
    return w * hs.to(h.dtype), h


def _rows(T, H, device, quick):
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(H)
    x = torch.randn(T, H, device=device, dtype=dt, generator=g)
    res = torch.randn(T, H, device=device, dtype=dt, generator=g)
    w = 1 + 0.1 * torch.randn(H, device=device, dtype=dt, generator=g)
    dout, dh = torch.randn_like(x), torch.randn_like(x)
    it = dict(iters=10 if quick else 30)
    es = x.element_size()
    fwd_bytes, bwd_bytes = 4 * T * H * es, 4 * T * H * es
    hf_c = torch.compile(_hf)
    out, h, rstd = torch.ops.mmfuse.rms_norm(x, res, w, 1e-6)
    want_out, want_h = _hf(x, res, w)
    close = torch.equal(h, want_h) and bool(((out.float() - want_out.float()).abs()
                                             <= 2 ** -7 * want_out.float().abs() + 2 ** -6).all())
    verdict = "close" if close else "FAIL"

    def hf_fb(fn):
        xs, rs, ws = (t.detach().requires_grad_() for t in (x, res, w))

        def step():
            o, hh = fn(xs, rs, ws)
            torch.autograd.grad((o, hh), (xs, rs, ws), (dout, dh))
        return step

    rows = []
    tag = f"T{T} H{H}"
    t_e, s_e = time_us(lambda: _hf(x, res, w), device, **it)
    t_c, s_c = time_us(lambda: hf_c(x, res, w), device, **it)
    t_o, s_o = time_us(lambda: torch.ops.mmfuse.rms_norm(x, res, w, 1e-6), device, **it)
    rows += [Row(f"{tag} fwd  HF eager", t_e, s_e, fwd_bytes), Row(f"{tag} fwd  HF torch.compile", t_c, s_c, fwd_bytes),
             Row(f"{tag} fwd  mmfuse", t_o, s_o, fwd_bytes, t_c, "vs compile", verdict)]
    hs, ws = h.double().requires_grad_(), w.double().requires_grad_()  # from the rounded residual sum, as saved
    want_dx, want_dw = torch.autograd.grad(_hf(hs, torch.zeros_like(hs), ws), (hs, ws), (dout.double(), dh.double()))
    # the weight gradient sums dout * round(xhat) (HF's numerics: xhat rounded to the input dtype before
    # the weight multiplies it) in fp32: T independent roundings of 2^-9 relative at most, so within a
    # few 2^-8 of the root sum of squares of the terms (a lost block of rows is far outside), plus fp32
    t = dout.double() * h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    u = 2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -24
    dw_bound = 4 * u * t.pow(2).sum(0).sqrt() + 2.0 ** -20 * t.abs().sum(0)
    for path in ("auto", "single") if device == "cuda" else ("auto",):
        with path_override("MMFUSE_RMS_NORM_BWD", path):
            dx, _, dw = torch.ops.mmfuse.rms_norm_backward(dout, dh, h, rstd, w)
            ok = bool(((dx.double() - want_dx).abs() <= 2 ** -7 * want_dx.abs() + 2 ** -6).all()) and \
                bool(((dw.double() - want_dw).abs() <= dw_bound).all())
            t_o, s_o = time_us(lambda: torch.ops.mmfuse.rms_norm_backward(dout, dh, h, rstd, w), device, **it)
        name = "bwd  mmfuse (kernel)" if path == "auto" else "bwd  mmfuse (kernel, one row in flight)"
        rows.append(Row(f"{tag} {name}", t_o, s_o, bwd_bytes, verified="close" if ok else "FAIL"))
    t_e, s_e = time_us(hf_fb(_hf), device, **it)
    t_c, s_c = time_us(hf_fb(hf_c), device, **it)
    t_o, s_o = time_us(hf_fb(lambda a, b, c: mmfuse.rms_norm(a, c, 1e-6, b)), device, **it)
    rows += [Row(f"{tag} f+b  HF eager", t_e, s_e, fwd_bytes + bwd_bytes),
             Row(f"{tag} f+b  HF torch.compile", t_c, s_c, fwd_bytes + bwd_bytes),
             Row(f"{tag} f+b  mmfuse", t_o, s_o, fwd_bytes + bwd_bytes, t_c, "vs compile", verdict)]
    return rows


def run(device: str, quick: bool = False) -> dict:
    shapes = [(16384, 2048), (16384, 3584)] if device == "cuda" else [(64, 96)]
    return run_bandwidth_family("rms_norm", "rms_norm (bf16, residual add + RMSNorm; speedup = torch.compile time / mmfuse time)", shapes, _rows, device, quick)
