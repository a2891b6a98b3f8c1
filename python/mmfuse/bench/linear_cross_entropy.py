"""``mmfuse-bench linear_cross_entropy``: fused linear cross-entropy at an LM head's shapes (bf16, T =
16384 tokens of hidden 2048, Qwen2.5-VL's vocabulary of 151936), forward + backward, against
``F.linear`` + ``F.cross_entropy`` in eager PyTorch and under torch.compile, and against the same
chunked in plain PyTorch: time and the peak memory the step adds."""

import importlib

import torch
import torch.nn.functional as F

import mmfuse

from .common import path_override, time_us, time_us_interleaved


def _torch(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def _torch_chunked(h, w, y, chunk=1024):
    """The usual memory fix in PyTorch: the loss a chunk at a time, each chunk checkpointed."""
    from torch.utils.checkpoint import checkpoint

    n = (y != -100).sum().clamp_min(1)
    total = 0.0
    for i in range(0, h.shape[0], chunk):
        total = total + checkpoint(lambda a, b: F.cross_entropy(F.linear(a, w).float(), b, reduction="sum"),
                                   h[i:i + chunk], y[i:i + chunk], use_reentrant=False)
    return total / n


def _one_read(a, b, c):
    """mmfuse with the logits gradient's one-read kernel (MMFUSE_LCE_GRAD=cluster: each row's slices held
    in a thread-block cluster's shared memory) where the default runs the two-pass one."""
    with path_override("MMFUSE_LCE_GRAD", "cluster"):
        return mmfuse.linear_cross_entropy(a, b, c)


def _with_setting(name: str, value):
    """mmfuse with one of its module settings changed for the call (DW_GROUP_TOKENS: the weight gradient's
    GEMM over that many tokens' chunks at once; DH_PER_GROUP True: d_hidden's GEMM a group at a time)."""
    lce = importlib.import_module("mmfuse.linear_cross_entropy")  # the package's name is the function

    def fn(a, b, c):
        saved = getattr(lce, name)
        setattr(lce, name, value)
        try:
            return mmfuse.linear_cross_entropy(a, b, c)
        finally:
            setattr(lce, name, saved)
    return fn


def _bound_us(h, w, it) -> float:
    """The step's three GEMMs alone at full size (the logits, then d_hidden and d_weight from a [T, V]
    gradient in hidden's dtype), back to back: the time any fused or unfused step spends at least."""
    z = torch.empty(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)
    dh, dw = torch.empty_like(h), torch.empty_like(w)

    def gemms():
        torch.mm(h, w.t(), out=z)
        torch.mm(z, w, out=dh)  # z stands in for the logits' gradient: same shape and dtype
        torch.mm(z.t(), h, out=dw)
    us = time_us(gemms, "cuda", **it)[0]
    del z
    return us


def _chunked_gemms_us(h, w, it) -> float:
    """mmfuse's GEMMs alone at its defaults: each 1024-token chunk's logits and d_hidden (a group's at
    once where DH_PER_GROUP), the weight gradient (accumulated in fp32) once a 4096-token group (the
    accumulator's passes are the price of never holding [T, V]): the floor of the chunked step."""
    lce = importlib.import_module("mmfuse.linear_cross_entropy")
    chunk, group, per_group = 1024, lce.DW_GROUP_TOKENS, lce.DH_PER_GROUP
    g = torch.empty(group, w.shape[0], device=h.device, dtype=h.dtype)
    dh, dw = torch.empty_like(h), torch.zeros(w.shape, device=h.device, dtype=torch.float32)
    empty = g[:0, :0]

    def gemms():
        for i0 in range(0, h.shape[0], group):
            for i in range(i0, i0 + group, chunk):
                z = g[i - i0:i - i0 + chunk]  # stands in for the chunk's logits and their gradient
                torch.mm(h[i:i + chunk], w.t(), out=z)
                if not per_group:
                    torch.mm(z, w, out=dh[i:i + chunk])
            if per_group:
                torch.mm(g, w, out=dh[i0:i0 + group])
            torch.ops.mmfuse.dual_gemm_out(g, h[i0:i0 + group], empty, empty, dw, dw[:0, :0], True, False, i0 > 0)
    us = time_us(gemms, "cuda", **it)[0]
    del g
    return us


def run(device: str, quick: bool = False) -> dict:
    T, H, V = (16384, 2048, 151936) if device == "cuda" else (256, 64, 1000)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(T, H, device=device, dtype=dt, generator=g)
    w = (torch.randn(V, H, device=device, dtype=dt, generator=g) / H ** 0.5)
    y = torch.randint(0, V, (T,), device=device, generator=g)
    it = dict(iters=5 if quick else 10, warmup=2)
    compiled = torch.compile(_torch)
    variants = [("F.linear + cross_entropy, eager", _torch), ("same, torch.compile", compiled),
                ("chunked PyTorch (checkpointed)", _torch_chunked),
                # the chunk size's trade (time against memory), then the default (1024)
                ("mmfuse, 512-token chunks", lambda a, b, c: mmfuse.linear_cross_entropy(a, b, c, chunk_tokens=512)),
                ("mmfuse, 2048-token chunks", lambda a, b, c: mmfuse.linear_cross_entropy(a, b, c, chunk_tokens=2048)),
                # the logits in fp32 (finer than the unfused step's; twice their traffic)
                ("mmfuse, logits in fp32",
                 lambda a, b, c: mmfuse.linear_cross_entropy(a, b, c, logits_dtype=torch.float32)),
                # the logits gradient read once (a cluster a row) against twice (the default, for now)
                ("mmfuse, one-read logits gradient", _one_read),
                # d_hidden's GEMM a group at a time, with the weight gradient's (default: a chunk at a time)
                ("mmfuse, d_hidden a group at a time", _with_setting("DH_PER_GROUP", True)),
                # the weight gradient's accumulator passes (default: every 4096 tokens)
                ("mmfuse, weight gradient every 2048 tokens", _with_setting("DW_GROUP_TOKENS", 2048)),
                ("mmfuse, weight gradient every 8192 tokens", _with_setting("DW_GROUP_TOKENS", 8192)),
                # the weight gradient accumulated in bf16 (as Liger-Kernel does): no fp32 [V, H] buffer
                ("mmfuse, weight gradient in bf16",
                 lambda a, b, c: mmfuse.linear_cross_entropy(a, b, c, weight_grad_dtype=a.dtype)),
                ("mmfuse.linear_cross_entropy", lambda a, b, c: mmfuse.linear_cross_entropy(a, b, c))]
    rows = []
    want = None
    print(f"\n## linear_cross_entropy (T {T}, H {H}, V {V}, {str(dt).replace('torch.', '')}; forward + backward)")
    bound = _bound_us(h, w, it) if device == "cuda" else None
    if bound is not None:
        chunked = _chunked_gemms_us(h, w, it)
        for name, us in (("bound: the three GEMMs alone", bound), ("the chunked GEMMs alone (mmfuse's)", chunked)):
            rows.append(dict(name=name, us=us, x_bound=us / bound, verified="n/a"))
            print(f"| {name:<34} | {us / 1e3:8.2f} ms | x bound {us / bound:5.2f} |", flush=True)
    steps, variant_rows = [], []
    for name, fn in variants:
        hs, ws = h.detach().requires_grad_(), w.detach().requires_grad_()

        def step(fn=fn, hs=hs, ws=ws):
            loss = fn(hs, ws, y)
            loss.backward()
            hs.grad = ws.grad = None  # no variant holds its gradients while the others run
            return loss

        loss = float(step().detach())
        want = loss if want is None else want
        row = dict(name=name, loss=loss, verified="close" if abs(loss - want) <= 1e-2 * abs(want) else "FAIL")
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
        rows.append(row)
        variant_rows.append(row)
        steps.append(step)
    if device == "cuda":
        # every variant sampled in turn, round after round: a drift of the card's clock falls on all alike
        for row, (us, spread) in zip(variant_rows, time_us_interleaved(steps, device, warmup=2, rounds=it["iters"])):
            row.update(us=us, spread_us=spread, x_bound=us / bound)
            print(f"| {row['name']:<34} | {us / 1e3:8.2f} ms | x bound {row['x_bound']:5.2f} | peak +"
                  f"{row['peak_gib']:6.2f} GiB | loss {row['loss']:.5f} | {row['verified']} | spread "
                  f"{spread / 1e3:.2f} ms |", flush=True)
    if device == "cuda":
        base = {r["name"]: r for r in rows}
        ours = rows[-1]
        print(f"linear_cross_entropy: {base['same, torch.compile']['us'] / ours['us']:.2f}x compiled PyTorch's time, "
              f"{ours['peak_gib'] / base['F.linear + cross_entropy, eager']['peak_gib']:.3f}x eager PyTorch's peak memory")
    return dict(rows=rows, all_verified=all(r["verified"] in ("close", "n/a") for r in rows))
