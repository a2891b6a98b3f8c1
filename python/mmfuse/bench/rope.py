"""``mmfuse-bench rope``: text mRoPE (Qwen2.5-VL-7B heads: 28 q / 4 kv, D=128, bf16, realistic
multimodal positions) and vision RoPE (16 heads, D=80) against HF's formula in eager PyTorch and under
torch.compile, with the copy-bandwidth ceiling of the same run."""

import time

import torch

import mmfuse

from .common import Row, copy_bandwidth_gbs, print_table, time_us
from .references import hf_apply, hf_tables, hf_vision, inv_freq_of, make_positions, vision_freqs

SECTION = [16, 24, 24]


def _verdict(pairs, exact=True) -> str:
    """'bitwise'; else, for a required-exact check on the GPU, 'FAIL n'; on the CPU (host libm angles)
    'close' within two bf16 ulps; informational comparisons give 'n diff'."""
    pairs = list(pairs)
    bad = sum(int((a != b).sum()) for a, b in pairs)
    if bad == 0:
        return "bitwise"
    if not exact:
        return f"{bad} diff"
    if pairs[0][0].device.type == "cpu":
        close = all(bool(((a.float() - b.float()).abs() <= 2 ** -6 * b.float().abs() + 1e-3).all()) for a, b in pairs)
        return "close" if close else f"FAIL {bad}"
    return f"FAIL {bad}"


def _text_rows(B, L, device, quick, hq=28, hk=4, D=128):
    dt = torch.bfloat16
    pos = make_positions(B, L, device, seed=B * L)
    inv = inv_freq_of(D, device)
    cos, sin = hf_tables(pos, inv, dt)
    q = torch.randn(B, hq, L, D, dtype=dt, device=device)
    k = torch.randn(B, hk, L, D, dtype=dt, device=device)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    it = dict(iters=10 if quick else 30)
    qk_bytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write
    pos_bytes = pos.numel() * pos.element_size() + inv.numel() * 4
    tab_bytes = 2 * B * L * D * cos.element_size()  # the cos and sin entries a token needs
    tag = f"B{B} L{L}"
    ops = torch.ops.mmfuse

    def hf_fwd(q, k, cos, sin):
        return (hf_apply(q, cos, sin, SECTION, False, "hf_eager"), hf_apply(k, cos, sin, SECTION, False, "hf_eager"))

    def hf_bwd(gq, gk, cos, sin):
        return (hf_apply(gq, cos, sin, SECTION, False, "hf_eager", backward=True),
                hf_apply(gk, cos, sin, SECTION, False, "hf_eager", backward=True))

    hf_fwd_c = torch.compile(hf_fwd)
    hf_bwd_c = torch.compile(hf_bwd)

    # correctness in the same run
    ours_pos = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=SECTION)
    ours_tab_eager = mmfuse.mrope(q, k, cos, sin, mrope_section=SECTION, numerics="hf_eager")
    ours_tab_fp32 = mmfuse.mrope(q, k, cos, sin, mrope_section=SECTION)
    cos32, sin32 = hf_tables(pos, inv, torch.float32)
    ref_fp32 = (hf_apply(q, cos32, sin32, SECTION, False, "fp32"), hf_apply(k, cos32, sin32, SECTION, False, "fp32"))
    ref_eager = hf_fwd(q, k, cos, sin)
    ref_comp = hf_fwd_c(q, k, cos, sin)
    v_pos = _verdict(zip(ours_pos, ref_fp32))
    v_eager = _verdict(zip(ours_tab_eager, ref_eager))
    v_comp = _verdict(zip(ours_tab_fp32, ref_comp), exact=False)
    bwd_ours = ops.mrope_backward.default(gq, gk, None, None, pos, inv, SECTION, False, "hf_eager", True)
    bwd_tab = ops.mrope_backward.default(gq, gk, cos, sin, None, None, SECTION, False, "hf_eager", True)
    v_bwd = _verdict(zip(bwd_tab, hf_bwd(gq, gk, cos, sin)))

    t_hf_e, s_hf_e = time_us(lambda: hf_fwd(q, k, cos, sin), device, **it)
    t_hf_c, s_hf_c = time_us(lambda: hf_fwd_c(q, k, cos, sin), device, **it)
    rows = [
        Row(f"{tag} fwd  HF eager (cos/sin)", t_hf_e, s_hf_e, qk_bytes + tab_bytes),
        Row(f"{tag} fwd  HF torch.compile (cos/sin)", t_hf_c, s_hf_c, qk_bytes + tab_bytes),
    ]
    t, s = time_us(lambda: mmfuse.mrope(q, k, cos, sin, mrope_section=SECTION), device, **it)
    rows.append(Row(f"{tag} fwd  mmfuse cos/sin", t, s, qk_bytes + tab_bytes, t_hf_c, "vs compile", v_eager))
    t, s = time_us(lambda: mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=SECTION), device, **it)
    rows.append(Row(f"{tag} fwd  mmfuse positions", t, s, qk_bytes + pos_bytes, t_hf_c, "vs compile", v_pos))
    t_fwd_pos = t

    t_hb_e, s_hb_e = time_us(lambda: hf_bwd(gq, gk, cos, sin), device, **it)
    t_hb_c, s_hb_c = time_us(lambda: hf_bwd_c(gq, gk, cos, sin), device, **it)
    rows.append(Row(f"{tag} bwd  HF eager", t_hb_e, s_hb_e, qk_bytes + tab_bytes))
    rows.append(Row(f"{tag} bwd  HF torch.compile", t_hb_c, s_hb_c, qk_bytes + tab_bytes))
    t, s = time_us(lambda: ops.mrope_backward.default(gq, gk, None, None, pos, inv, SECTION, False, "fp32", True),
                   device, **it)
    rows.append(Row(f"{tag} bwd  mmfuse positions", t, s, qk_bytes + pos_bytes, t_hb_c, "vs compile", v_bwd))
    t_bwd_pos = t
    del bwd_ours

    # forward + backward through autograd (no grad accumulation: autograd.grad)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()

    def fb(fwd):
        def run():
            qo, ko = fwd(qr, kr)
            return torch.autograd.grad((qo, ko), (qr, kr), (gq, gk))
        return run

    hf_fb_c = torch.compile(lambda a, b: hf_fwd(a, b, cos, sin))
    t_fb_e, s_fb_e = time_us(fb(lambda a, b: hf_fwd(a, b, cos, sin)), device, **it)
    t_fb_c, s_fb_c = time_us(fb(hf_fb_c), device, **it)
    rows.append(Row(f"{tag} f+b  HF eager", t_fb_e, s_fb_e, 2 * (qk_bytes + tab_bytes)))
    rows.append(Row(f"{tag} f+b  HF torch.compile", t_fb_c, s_fb_c, 2 * (qk_bytes + tab_bytes)))
    t, s = time_us(fb(lambda a, b: mmfuse.mrope(a, b, positions=pos, inv_freq=inv, mrope_section=SECTION)), device,
                   **it)
    rows.append(Row(f"{tag} f+b  mmfuse positions", t, s, 2 * (qk_bytes + pos_bytes), t_fb_c, "vs compile", v_pos))
    summary = dict(fwd_us=t_fwd_pos, bwd_us=t_bwd_pos, fb_us=t, fb_speedup_vs_compile=t_fb_c / t,
                   fwd_gbs=(qk_bytes + pos_bytes) / (t_fwd_pos * 1e-6) / 1e9,
                   bwd_gbs=(qk_bytes + pos_bytes) / (t_bwd_pos * 1e-6) / 1e9,
                   verified=dict(positions_vs_fp32_formula=v_pos, hf_eager_vs_eager=v_eager,
                                 fp32_vs_compiled=v_comp, bwd_hf_eager=v_bwd))
    return rows, summary


def _vision_rows(N, device, quick, H=16, D=80):
    dt = torch.bfloat16
    freqs = vision_freqs(N, D, device)
    q = torch.randn(N, H, D, dtype=dt, device=device)
    k = torch.randn(N, H, D, dtype=dt, device=device)
    it = dict(iters=10 if quick else 30)
    nbytes = 2 * (q.numel() + k.numel()) * 2 + freqs.numel() * 4
    ref = hf_vision(q, k, freqs)
    hf_c = torch.compile(hf_vision)
    v = _verdict(zip(mmfuse.vision_rope(q, k, freqs), ref))
    v_c = _verdict(zip(mmfuse.vision_rope(q, k, freqs), hf_c(q, k, freqs)), exact=False)
    t_e, s_e = time_us(lambda: hf_vision(q, k, freqs), device, **it)
    t_c, s_c = time_us(lambda: hf_c(q, k, freqs), device, **it)
    t, s = time_us(lambda: mmfuse.vision_rope(q, k, freqs), device, **it)
    g = torch.randn_like(q)
    tb, sb = time_us(lambda: torch.ops.mmfuse.vision_rope_backward.default(g, g, freqs), device, **it)
    rows = [
        Row(f"vision N{N} H{H} D{D} fwd HF eager", t_e, s_e, nbytes),
        Row(f"vision N{N} H{H} D{D} fwd HF torch.compile", t_c, s_c, nbytes),
        Row(f"vision N{N} H{H} D{D} fwd mmfuse", t, s, nbytes, t_c, "vs compile", v),
        Row(f"vision N{N} H{H} D{D} bwd mmfuse", tb, sb, nbytes, t_c, "vs compile", v),
    ]
    return rows, dict(fwd_us=t, bwd_us=tb, fwd_gbs=nbytes / (t * 1e-6) / 1e9, bwd_gbs=nbytes / (tb * 1e-6) / 1e9,
                      verified=v, verified_vs_compiled=v_c)


def _host_overhead_us(device):
    """Wall time of one eager mmfuse.mrope call on tiny inputs (launch-bound), and of torch.add."""
    q = torch.randn(1, 2, 4, 64, device=device)
    k = torch.randn(1, 2, 4, 64, device=device)
    pos = torch.zeros(3, 1, 4, dtype=torch.long, device=device)
    inv = inv_freq_of(64, device)

    def per_call(fn, n=5000):
        for _ in range(200):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    op = torch.ops.mmfuse.mrope.default
    sec = [8, 12, 12]
    return dict(mrope_us=per_call(lambda: mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=sec)),
                torch_ops_us=per_call(lambda: op(q, k, None, None, pos, inv, sec, False, "fp32", True)),
                torch_add_us=per_call(lambda: torch.add(q, k)),
                empty_like_us=per_call(lambda: (torch.empty_like(q), torch.empty_like(k))))


def run(device: str, quick: bool = False) -> dict:
    copy = copy_bandwidth_gbs(device)
    print(f"\ncopy bandwidth (read + write): {copy:.0f} GB/s")
    out = {"copy_gbs": copy}
    rows = []
    if device == "cuda":
        shapes, vision_n = [(4, 4096), (1, 32768)], 16384
    else:
        shapes, vision_n = [(1, 256)], 1024
    for B, L in shapes:
        r, s = _text_rows(B, L, device, quick)
        rows += r
        out[f"text_B{B}_L{L}"] = s
    r, s = _vision_rows(vision_n, device, quick)
    rows += r
    out["vision"] = s
    print_table("rope (bf16; speedup = baseline time / mmfuse time)", rows, copy)
    ho = _host_overhead_us(device)
    out["host_overhead"] = ho
    print(f"\nhost overhead, one eager mmfuse.mrope call on tiny inputs: {ho['mrope_us']:.1f} us "
          f"(through torch.ops: {ho['torch_ops_us']:.1f} us; torch.add: {ho['torch_add_us']:.1f} us; "
          f"two empty_like: {ho['empty_like_us']:.1f} us)")
    out["all_verified"] = all(not r.verified.startswith("FAIL") for r in rows)
    for key, s in out.items():
        if isinstance(s, dict) and "fwd_gbs" in s:
            print(f"{key}: fwd {100 * s['fwd_gbs'] / copy:.1f}% of copy, bwd {100 * s['bwd_gbs'] / copy:.1f}% of copy"
                  + (f", f+b {s['fb_speedup_vs_compile']:.2f}x compiled HF" if "fb_speedup_vs_compile" in s else "")
                  + f", verified {s['verified']}")
    rows_json = [r.__dict__ for r in rows]
    out["rows"] = rows_json
    return out
