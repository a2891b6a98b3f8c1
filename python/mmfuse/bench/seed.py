"""``mmfuse-bench seed``: the seed-compatible functions (``mmfuse.backend``, ``mmfuse.fp8``'s seed
signatures), which WALL-X and AstrAI code calls directly, against mmfuse's native API and the best
plain alternative, in one run:

- ``backend.permute`` (no expert count: the order from a stable sort of the ids) against
  ``mmfuse.moe_permute`` with the count; rule: within 1.10x of the native call;
- ``backend.asym_dual_gmm_separated`` in the seed's layout (weights ``[K, N]``, ``trans_b=False``,
  outputs allocated) against two cuBLAS ``torch.mm`` and the native ``dual_gemm`` (``nn.Linear``
  weights); rule: at least as fast as the two cuBLAS calls;
- ``fp8.fp8_linear_forward`` (seed signature, dynamic scaling, bf16 where fp8 does not pay) against
  bf16 ``F.linear``; rule: no slower than bf16 where it falls back;
- the host overhead of one eager ``mmfuse.mrope`` call (small tensors, so the host bounds it) against
  one ``torch.add``; rule: within 1.3x.

Speedup = the alternative's time / the seed call's time; the calls compared are timed in turn, round
after round (``time_us_interleaved``), so a drift of the card's clock falls on both."""

import time

import torch
import torch.nn.functional as F

from .. import backend, moe
from .. import fp8 as _fp8
from ..dual_gemm import dual_gemm
from ..rope import mrope
from .common import Row, print_table, time_us_interleaved


def _host_us(fn, n: int) -> float:
    """Host time a call of fn in µs over n back-to-back eager calls (the device keeps up: tiny work)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    per = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return per


def _permute_rows(device, it):
    T, K, E, H = (8192, 8, 64, 4096) if device == "cuda" else (64, 2, 5, 24)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    idx = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32).to(device)
    seed_rows = backend.permute(x, idx, 0, None, 0)[0]
    native_rows = moe.moe_permute(x, idx, E)[0]
    verdict = "exact" if torch.equal(seed_rows, native_rows) else "FAIL"
    nbytes = 2 * T * K * H * x.element_size()
    (t_n, s_n), (t_s, s_s) = time_us_interleaved(
        [lambda: moe.moe_permute(x, idx, E), lambda: backend.permute(x, idx, 0, None, 0)], device, rounds=it["iters"])
    tag = f"permute T{T} K{K} E{E} H{H}"
    return [Row(f"{tag} native moe_permute", t_n, s_n, nbytes),
            Row(f"{tag} seed backend.permute", t_s, s_s, nbytes, t_n, "vs native", verdict)]


def _dual_gmm_rows(device, it):
    shapes = [((15872, 2048, 22016), (512, 2048, 4096)), ((15872, 11008, 2048), (512, 2048, 2048))] \
        if device == "cuda" else [((40, 24, 36), (8, 24, 12))]
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    rows = []
    for (m0, k0, n0), (m1, k1, n1) in shapes:
        a0, a1 = (torch.randn(m, k, generator=g).to(device, dt) for m, k in ((m0, k0), (m1, k1)))
        w0, w1 = (torch.randn(k, n, generator=g).to(device, dt) / k ** 0.5 for k, n in ((k0, n0), (k1, n1)))
        w0t, w1t = w0.t().contiguous(), w1.t().contiguous()  # nn.Linear layout [N, K] for the native call
        o0, o1 = backend.asym_dual_gmm_separated(a0, a1, w0, w1)
        ok = all(torch.allclose(o.float(), a.float() @ w.float(), rtol=2e-2, atol=2e-2)  # outputs of unit size
                 for o, a, w in ((o0, a0, w0), (o1, a1, w1)))
        verdict = "close" if ok else "FAIL"
        (t_mm, s_mm), (t_n, s_n), (t_s, s_s) = time_us_interleaved(
            [lambda: (torch.mm(a0, w0), torch.mm(a1, w1)), lambda: dual_gemm(a0, w0t, a1, w1t, trans_b=True),
             lambda: backend.asym_dual_gmm_separated(a0, a1, w0, w1)], device, rounds=it["iters"])
        tag = f"dual gmm {m0}x{k0}x{n0} + {m1}x{k1}x{n1}"
        rows += [Row(f"{tag} two torch.mm", t_mm, s_mm), Row(f"{tag} native dual_gemm", t_n, s_n, None, t_mm, "vs 2 mm"),
                 Row(f"{tag} seed asym_dual_gmm_separated", t_s, s_s, None, t_mm, "vs 2 mm", verdict)]
    return rows


def _fp8_rows(device, it):
    shapes = [(2048, 1024, 1024), (4096, 1000, 2000), (8192, 4096, 4096)] if device == "cuda" else [(48, 32, 40)]
    g = torch.Generator().manual_seed(2)
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, torch.bfloat16)
        b = torch.randn(N, generator=g).to(device, torch.bfloat16)
        want = F.linear(x.float(), w.float(), b.float())
        got = _fp8.fp8_linear_forward(x, w, b)
        err = float((got.float() - want).norm() / want.norm())
        verdict = "close" if err < 0.1 else "FAIL"  # e4m3 operands: a few % of the output's norm
        (t_b, s_b), (t_s, s_s) = time_us_interleaved(
            [lambda: F.linear(x, w, b), lambda: _fp8.fp8_linear_forward(x, w, b)], device, rounds=it["iters"])
        path = "fp8" if device != "cuda" or _fp8.fp8_pays(M, N, K) else "bf16 fallback"  # the CPU emulates fp8
        tag = f"fp8_linear_forward {M}x{K}x{N}"
        rows += [Row(f"{tag} bf16 F.linear", t_b, s_b),
                 Row(f"{tag} seed ({path})", t_s, s_s, None, t_b, "vs bf16", verdict)]
    return rows


def _mrope_host_rows(device):
    if device != "cuda":
        return []
    q = torch.randn(1, 16, 64, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 128, device=device, dtype=torch.bfloat16)
    cos = torch.randn(3, 1, 64, 128, device=device, dtype=torch.bfloat16)
    sin = torch.randn(3, 1, 64, 128, device=device, dtype=torch.bfloat16)
    section = [16, 24, 24]
    n = 2000
    t_add = _host_us(lambda: torch.add(q, q), n)
    t_m = _host_us(lambda: mrope(q, k, cos, sin, mrope_section=section), n)
    return [Row("host overhead: torch.add (one call)", t_add, 0.0),
            Row("host overhead: mmfuse.mrope (one call)", t_m, 0.0, None, t_add, "vs add")]


def run(device: str, quick: bool = False) -> dict:
    it = dict(iters=10 if quick else 30)
    rows = _permute_rows(device, it) + _dual_gmm_rows(device, it) + _fp8_rows(device, it) + _mrope_host_rows(device)
    print_table("seed API (mmfuse.backend, mmfuse.fp8 seed signatures) against native and plain calls; "
                "speedup = the alternative's time / this row's", rows, None)
    return dict(rows=[r.__dict__ for r in rows], all_verified=all(not r.verified.startswith("FAIL") for r in rows))
