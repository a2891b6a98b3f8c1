"""``mmfuse-bench moe``: MoE token routing (plan, permute, unpermute, unpermute backward) against the
PyTorch formulation (stable argsort + index_select; gather + fp32 weighted sum; index_copy + dot), bf16,
with the copy-bandwidth ceiling of the same run. Bytes count each input read once and each output
written once."""

import sys

import torch

import mmfuse

from .common import Row, copy_bandwidth_gbs, path_override, print_table, time_us

try:  # the sweep's fan-out ceiling only
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _routing(T, K, E, device, seed, skew=None):
    """Top-K of E per token from random logits (distinct experts a token); skew: for E = 2, K = 1, the
    fraction of tokens routed to expert 1 (the action tokens of a VLA batch)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if skew is not None:
        idx = (torch.rand(T, 1, generator=g) < skew).long()
        return idx.to(device), torch.ones(T, 1, device=device)
    logits = torch.randn(T, E, generator=g)
    probs, idx = torch.softmax(logits, -1).topk(K, dim=-1)
    return idx.to(device), probs.to(device)


# ---- the PyTorch baseline ----

def torch_permute(x, idx, num_out):
    K = idx.shape[1]
    order = torch.argsort(idx.reshape(-1), stable=True)[:num_out]
    return x.index_select(0, order // K), order


def torch_row_map(order, T, K):
    m = torch.full((T * K,), -1, dtype=torch.long, device=order.device)
    m[order] = torch.arange(order.numel(), device=order.device)
    return m.view(T, K).t()


def torch_unpermute(y, row_map, probs):
    K, T = row_map.shape
    kept = row_map >= 0
    g = y.index_select(0, row_map.clamp_min(0).reshape(-1)).view(K, T, -1).float()
    w = (probs.t() * kept)[..., None]
    return (g * w).sum(0).to(y.dtype)


def torch_unpermute_bwd(dout, y, row_map, probs):
    K, T = row_map.shape
    kept = (row_map >= 0).reshape(-1)
    rows = row_map.reshape(-1)[kept]
    tok = torch.arange(T, device=y.device).repeat(K)[kept]
    w = probs.t().reshape(-1)[kept]
    dy = torch.zeros_like(y)
    dy.index_copy_(0, rows, (w[:, None] * dout.float()[tok]).to(y.dtype))
    dprobs = torch.zeros(K * T, device=y.device)
    dprobs[kept] = (dout.float()[tok] * y.float()[rows]).sum(-1)
    return dy, dprobs.view(K, T).t()


# The benchmark's GPU cases: (name, T, H, K, E, options of _case)
_GPU_CASES = [("T16k H4096 2/8", 16384, 4096, 2, 8, {}),
              ("T64k H2048 8/64", 65536, 2048, 8, 64, {}),
              ("T16k H2048 2-expert", 16384, 2048, 1, 2, dict(skew=0.25)),  # 25% action tokens
              ("T8k H4096 8/64 drop", 8192, 4096, 8, 64, dict(drop=0.9))]  # T*K = 64K, 10% dropped


def _kept(T, K, drop):
    """Rows kept of T*K (num_out_tokens): all, or the fraction `drop`."""
    return T * K if drop is None else int(T * K * drop)


def _bytes(T, H, K, num_out, es):
    """Bytes each op moves, each input read once and each output written once: permute of the rows,
    unpermute, unpermute backward (the row_id_map, int32, and the fp32 probs / dprobs included)."""
    map_bytes = prob_bytes = 4 * T * K
    return dict(permute=T * H * es + num_out * H * es + map_bytes,
                unpermute=num_out * H * es + T * H * es + map_bytes + prob_bytes,
                backward=T * H * es + 2 * num_out * H * es + map_bytes + 2 * prob_bytes)


def _per_call_in_graph(fn, n, it):
    """Device time of one of n calls of fn captured back to back in a CUDA graph (one replay timed,
    divided by n): what a call costs in a captured training step, where no launch waits on the host."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    us, spread = time_us(graph.replay, "cuda", **it)
    return us / n, spread / n


def _case(name, T, H, K, E, device, quick, drop=None, skew=None, dt=torch.bfloat16):
    it = dict(iters=10 if quick else 30)
    idx, probs = _routing(T, K, E, device, seed=T + K + E, skew=skew)
    x = torch.randn(T, H, device=device).to(dt)
    num_out = _kept(T, K, drop)
    nbytes = _bytes(T, H, K, num_out, x.element_size())
    ops = torch.ops.mmfuse
    rows = []

    # plan alone, and the whole moe_permute (plan + rows), against argsort + index_select
    plan_us, plan_sp = time_us(lambda: ops.moe_plan(idx, E, num_out), device, **it)
    p = mmfuse.moe_permute(x, idx, E, num_out)
    want_rows, order = torch_permute(x, idx, num_out)
    want_map = torch_row_map(order, T, K)
    ok = torch.equal(p.rows, want_rows) and torch.equal(p.row_id_map.long(), want_map)
    ok = ok and torch.equal(p.counts, torch.bincount(idx.reshape(-1)[order], minlength=E))
    verdict = "exact" if ok else "FAIL"
    base_us, _ = time_us(lambda: torch_permute(x, idx, num_out), device, **it)
    rows.append(Row(f"{name} plan", plan_us, plan_sp, None, verified=verdict))
    if device == "cuda":  # the same plan in a captured step: 20 in a CUDA graph, per plan
        g_us, g_sp = _per_call_in_graph(lambda: ops.moe_plan(idx, E, num_out), 20, it)
        rows.append(Row(f"{name} plan, 20 in a CUDA graph, per plan", g_us, g_sp, None, verified=verdict))
        # each plan behind another kernel (the router's, in a model), which lets the plan's first kernel
        # start only as its own blocks end, unlike a plan before it: 20 pairs in a graph, less 20 add_
        one = torch.zeros(1, device=device)
        a_us, a_sp = _per_call_in_graph(lambda: (one.add_(1), ops.moe_plan(idx, E, num_out)), 20, it)
        add_us = _per_call_in_graph(lambda: one.add_(1), 20, it)[0]
        rows.append(Row(f"{name} plan after an add_, 20 in a CUDA graph, less the add_", a_us - add_us, a_sp,
                        None, verified=verdict))
    perm_bytes = nbytes["permute"]
    full_us, full_sp = time_us(lambda: mmfuse.moe_permute(x, idx, E, num_out), device, **it)
    rows.append(Row(f"{name} moe_permute (plan+rows)", full_us, full_sp, perm_bytes + idx.numel() * 8,
                    base_us, "argsort", verdict))
    m_us, m_sp = time_us(lambda: ops.moe_permute(x, p.row_id_map, num_out), device, **it)
    rows.append(Row(f"{name} permute rows", m_us, m_sp, perm_bytes, verified=verdict))

    # unpermute with probabilities, against gather + fp32 weighted sum
    y = torch.randn(num_out, H, device=device).to(dt)
    out = mmfuse.moe_unpermute(y, p.row_id_map, probs)
    want = torch_unpermute(y, p.row_id_map.long(), probs)
    diff = (out.float() - want.float()).abs().max().item() if out.numel() else 0.0
    verdict = "exact" if torch.equal(out, want) else ("close" if diff <= 2 ** -7 * want.float().abs().max().item()
                                                       else f"FAIL {diff:.2g}")
    u_us, u_sp = time_us(lambda: mmfuse.moe_unpermute(y, p.row_id_map, probs), device, **it)
    ub_us, _ = time_us(lambda: torch_unpermute(y, p.row_id_map.long(), probs), device, **it)
    rows.append(Row(f"{name} unpermute", u_us, u_sp, nbytes["unpermute"], ub_us, "gather+sum", verdict))

    # unpermute backward (dy and dprobs)
    dout = torch.randn(T, H, device=device).to(dt)
    dy, dp = ops.moe_unpermute_backward(dout, y, p.row_id_map, probs)
    wdy, wdp = torch_unpermute_bwd(dout, y, p.row_id_map.long(), probs)
    ok = torch.equal(dy, wdy) and torch.allclose(dp, wdp, rtol=1e-3, atol=1e-2)
    b_us, b_sp = time_us(lambda: ops.moe_unpermute_backward(dout, y, p.row_id_map, probs), device, **it)
    bb_us, _ = time_us(lambda: torch_unpermute_bwd(dout, y, p.row_id_map.long(), probs), device, **it)
    rows.append(Row(f"{name} unpermute bwd", b_us, b_sp, nbytes["backward"], bb_us, "index_copy",
                    "exact dy" if ok else "FAIL"))
    if device == "cuda":
        # The case's own buffers copied (dout into x, y into the permuted rows), next to the ops that
        # read them: where a case's buffers land in slow memory, this copy shows it too (see
        # _reserve_arena, which keeps them in one segment).
        c_us, c_sp = time_us(lambda: (x.copy_(dout), p.rows.copy_(y)), device, **it)
        rows.append(Row(f"{name} copy of its own buffers", c_us, c_sp, 2 * (T + num_out) * H * x.element_size(),
                        verified="-"))
    return rows


def _reserve_arena() -> None:
    """Reserves one segment of the caching allocator for every case's buffers (40 GiB, or 60 % of the
    free memory if less): allocated and freed at once, it stays cached and the cases' tensors are
    cut from it. Without it, a case that follows one whose baseline leaves many segments gets some
    buffers in small segments of their own, in which even a plain copy runs slower. The segments
    cached by what ran before (other families) are released first, so that the cases' tensors cannot
    be fitted into them instead."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    torch.empty(min(40 << 30, int(free * 0.6)), dtype=torch.uint8, device="cuda")


def _copy_us(nbytes, it):
    """Time of a device copy that reads and writes nbytes in all."""
    src = torch.randn(nbytes // 8, device="cuda")
    dst = torch.empty_like(src)
    return time_us(lambda: dst.copy_(src), "cuda", **it)[0]


if triton is not None:
    @triton.jit
    def _fanout_kernel(x, out, n, K: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr):
        """out[k] = x for k < K, x read once (evict-first), BLOCK elements a program."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = tl.load(x + offs, mask=m, eviction_policy="evict_first")
        for k in tl.static_range(K):
            if STREAM:
                tl.store(out + k * n + offs, v, mask=m, cache_modifier=".cs")
            else:
                tl.store(out + k * n + offs, v, mask=m)


def _fanout_us(T, H, K, it):
    """Time of the best streaming kernel for the permute's traffic: each element of a [T, H] bf16
    tensor read once and written to K contiguous copies (Triton, plain and streaming-store variants,
    two block sizes; the fastest counts): the ceiling of the permute's bytes-per-second, next to the
    1 GiB copy's. None where Triton is not installed."""
    if triton is None:
        return None, "triton not installed"
    x = torch.randn(T, H * 2 // 4, device="cuda")  # the bf16 rows' bytes, as 32-bit words
    out = torch.empty(K, *x.shape, device="cuda")
    n = x.numel()
    best, tag = None, ""
    for block in (2048, 8192):
        for stream in (False, True):
            grid = (triton.cdiv(n, block),)
            fn = lambda: _fanout_kernel[grid](x, out, n, K=K, BLOCK=block, STREAM=stream, num_warps=8)  # noqa: E731
            fn()
            if not all(torch.equal(out[k], x) for k in range(K)):
                return None, f"fan-out K {K} block {block} WRONG"
            us = time_us(fn, "cuda", **it)[0]
            if best is None or us < best:
                best, tag = us, f"block {block}{' .cs stores' if stream else ''}"
    return best, tag


def sweep(quick: bool = True) -> None:
    """Every launch of the plan (MMFUSE_MOE_PLAN: auto, cooperative, two), every path of the backward
    (MMFUSE_MOE_BWD: auto, tile, general, warp, entry) on the benchmark's cases and a few more, each
    output compared bitwise with the default's, the unpermute and the permute of the rows;
    and a copy of the backward's own bytes, so that the fixed cost of a short launch shows next to the
    1 GiB copy ceiling that the percentages are of; and a streaming fan-out of the permute's rows (each
    read once, written K times contiguously), the ceiling of its traffic without the routing."""
    it = dict(iters=10 if quick else 30)
    ops = torch.ops.mmfuse
    _reserve_arena()
    copy = copy_bandwidth_gbs("cuda")
    print(f"\ncopy bandwidth (read + write, 1 GiB): {copy:.0f} GB/s")
    one = torch.randn(1, device="cuda")
    floor_us = time_us(lambda: one.add_(1), "cuda", **it)[0]
    print(f"one kernel (a one-element add_), the floor of any timed launch: {floor_us:.1f} us")
    floor_n_us = time_us(lambda: [one.add_(1) for _ in range(20)], "cuda", **it)[0]
    floor_graph_us = _per_call_in_graph(lambda: one.add_(1), 20, it)[0]
    print(f"one-element add_: 20 back to back {floor_n_us / 20:.1f} us each, 20 in a CUDA graph "
          f"{floor_graph_us:.1f} us each")
    cases = _GPU_CASES + [("T64k H2048 2-expert", 65536, 2048, 1, 2, dict(skew=0.25)),
                          ("T16k H4096 2-expert", 16384, 4096, 1, 2, dict(skew=0.25)),
                          ("T32k H2048 2/8", 32768, 2048, 2, 8, {}), ("T32k H2048 2/64", 32768, 2048, 2, 64, {})]
    pct = lambda nbytes, us: 100 * nbytes / (us * 1e-6) / 1e9 / copy  # noqa: E731
    for name, T, H, K, E, kw in cases:
        idx, probs = _routing(T, K, E, "cuda", seed=T + K + E, skew=kw.get("skew"))
        num_out = _kept(T, K, kw.get("drop"))
        want = ops.moe_plan(idx, E, num_out)
        row_map = want[0]
        line, in_graph = [], []
        n = 20
        for mode in ("auto", "cooperative", "two"):
            with path_override("MMFUSE_MOE_PLAN", mode):
                us, _ = time_us(lambda: ops.moe_plan(idx, E, num_out), "cuda", **it)
                same = all(torch.equal(a, b) for a, b in zip(ops.moe_plan(idx, E, num_out), want))
                try:  # (a launch that cannot be captured is reported, not fatal to the sweep)
                    g = f"{_per_call_in_graph(lambda: ops.moe_plan(idx, E, num_out), n, it)[0]:.1f}"
                except RuntimeError as err:
                    g = f"not captured ({str(err).splitlines()[0][:80]})"
            line.append(f"{mode} {us:.1f}{'' if same else ' DIFFERS'}")
            in_graph.append(f"{mode} {g}")
        # in a stream: n plans queued back to back (the launch of each hidden behind the one before),
        # the time a plan adds to a step, next to n one-element add_ launches; and n in a CUDA graph
        with path_override("MMFUSE_MOE_PLAN", "auto"):
            us, _ = time_us(lambda: [ops.moe_plan(idx, E, num_out) for _ in range(n)], "cuda", **it)
        line.append(f"auto, {n} back to back {us / n:.1f} a plan (add_ {floor_n_us / n:.1f})")
        line.append(f"{n} in a CUDA graph, a plan: " + " ".join(in_graph) + f" (add_ {floor_graph_us:.1f})")
        print(f"sweep {name} (T*K {T * K}): plan us: " + ", ".join(line))
        y = torch.randn(num_out, H, device="cuda").to(torch.bfloat16)
        dout = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        nb = _bytes(T, H, K, num_out, y.element_size())
        nbytes = nb["backward"]
        c_us = _copy_us(nbytes, it)
        ref = ops.moe_unpermute_backward(dout, y, row_map, probs)
        line = []
        for mode in ("auto", "tile", "general", "warp", "entry"):
            with path_override("MMFUSE_MOE_BWD", mode):
                us, _ = time_us(lambda: ops.moe_unpermute_backward(dout, y, row_map, probs), "cuda", **it)
                got = ops.moe_unpermute_backward(dout, y, row_map, probs)
            tag = "" if torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) else (
                " (dprobs differ)" if torch.equal(got[0], ref[0]) else " DY DIFFERS")
            line.append(f"{mode} {pct(nbytes, us):.1f}{tag}")
        print(f"sweep {name}: backward % of copy: " + ", ".join(line) +
              f" | a copy of the same {nbytes / 2 ** 20:.0f} MiB: {pct(nbytes, c_us):.1f}")
        u_us, _ = time_us(lambda: mmfuse.moe_unpermute(y, row_map, probs), "cuda", **it)
        line = [f"{pct(nb['unpermute'], u_us):.1f}"]
        p_us, _ = time_us(lambda: ops.moe_permute(dout, row_map, num_out), "cuda", **it)
        f_us, f_tag = _fanout_us(T, H, K, it)
        fan = f"{pct(T * H * 2 * (1 + K), f_us):.1f} ({f_tag})" if f_us else f_tag
        print(f"sweep {name}: unpermute " + ", ".join(line) + f"; permute rows {pct(nb['permute'], p_us):.1f} "
              f"% of copy | a fan-out of the same rows, read once and written {K}x contiguously: {fan}")


def run(device: str, quick: bool = False) -> dict:
    if device == "cuda":
        _reserve_arena()
    copy = copy_bandwidth_gbs(device)
    print(f"\ncopy bandwidth (read + write): {copy:.0f} GB/s")
    if device == "cuda":
        cases = _GPU_CASES
    else:
        cases = [("T1k H256 2/8", 1024, 256, 2, 8, {}), ("T1k H256 2-expert", 1024, 256, 1, 2, dict(skew=0.25))]
    rows = []
    for name, T, H, K, E, kw in cases:
        rows += _case(name, T, H, K, E, device, quick, **kw)
    print_table("moe (bf16; speedup = PyTorch time / mmfuse time)", rows, copy)
    for r in rows:
        if r.nbytes is None:
            print(f"moe {r.name}: {r.us:.1f} us")
        elif device == "cuda":
            print(f"moe {r.name}: {100 * r.nbytes / (r.us * 1e-6) / 1e9 / copy:.1f}% of copy")
    return dict(copy_gbs=copy, rows=[r.__dict__ for r in rows],
                all_verified=all(not r.verified.startswith("FAIL") for r in rows))


def plans(reps: int = 3) -> None:
    """Each launch of the plan (MMFUSE_MOE_PLAN) `reps` times at T*K = 64K, top-8 of 64, after one
    warm-up each: a workload for a profiler (ncu --kernel-name regex:moe_)."""
    idx, _ = _routing(8192, 8, 64, "cuda", seed=0)
    for mode in ("auto", "cooperative", "two"):
        with path_override("MMFUSE_MOE_PLAN", mode):
            for _ in range(reps + 1):
                torch.ops.mmfuse.moe_plan(idx, 64, idx.numel())
    torch.cuda.synchronize()


if __name__ == "__main__":  # python -m mmfuse.bench.moe sweep|plans
    if sys.argv[1:] not in (["sweep"], ["plans"]) or not torch.cuda.is_available():
        sys.exit("usage (on a GPU): python -m mmfuse.bench.moe sweep|plans")
    sweep() if sys.argv[1] == "sweep" else plans()
