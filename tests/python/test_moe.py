"""MoE routing ops on the CPU and CUDA against a float64 reference (stable argsort + gather + weighted
sum): K in {1, 2, 4, 8}, E in {2, 8, 64, 256}, dropping, T = 0 and 1, odd H, dtypes; CUDA equal to the
CPU bitwise (dprobs to fp32 rounding), deterministic; gradcheck, opcheck, torch.compile, CUDA graphs, no
host syncs, bad input (on the GPU: a device-side assertion, in a child process); the seed's functions."""

import os
import subprocess
import sys

import pytest
import torch

import mmfuse
from mmfuse import backend
from mmfuse.bench.common import path_override

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _reference(x, indices, probs, num_out):
    T, K = indices.shape
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    n = num_out or T * K
    kept = order[:n]
    rows = x.double()[kept // K]
    row_id_map = torch.full((T * K,), -1, dtype=torch.long)
    row_id_map[kept] = torch.arange(n)
    row_id_map = row_id_map.view(T, K).t()
    w = torch.ones(T, K, dtype=torch.float64) if probs is None else probs.double()
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for k in range(K):
        r = row_id_map[k]
        keep = r >= 0
        out[keep] += w[keep, k, None] * rows[r[keep]]
    return rows, row_id_map, out


def _indices(T, K, E, g):
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K,
                                                                                                      dtype=torch.long)


@pytest.mark.parametrize("K,E", [(1, 2), (2, 8), (4, 64), (8, 256), (2, 2)])
@pytest.mark.parametrize("T", [0, 1, 37, 257])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_against_float64_reference(K, E, T, drop, device):
    g = torch.Generator().manual_seed(T * 1000 + K * 10 + E)
    H = 13
    x = torch.randn(T, H, generator=g)
    idx = _indices(T, K, E, g).to(torch.int32 if K % 2 else torch.int64)
    probs = torch.rand(T, K, generator=g)
    num_out = (T * K * 3) // 4 if drop else None
    p = mmfuse.moe_permute(x.to(device), idx.to(device), E, num_out)
    assert p.rows.device.type == p.row_id_map.device.type == p.counts.device.type == device
    p = mmfuse.Permuted(*(t.cpu() for t in p))
    rows, row_id_map, out = _reference(x, idx, probs, num_out)
    assert torch.equal(p.rows.double(), rows) and torch.equal(p.row_id_map.long(), row_id_map)
    assert torch.equal(p.counts, torch.bincount(idx.reshape(-1).long()[torch.argsort(idx.reshape(-1).long(),
                                                stable=True)[:num_out or T * K]], minlength=E))
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    got = mmfuse.moe_unpermute(*dev(p.rows, p.row_id_map, probs)).cpu()
    torch.testing.assert_close(got.double(), out, rtol=1e-6, atol=1e-6)
    # float64 inputs: the same k order, so exact
    got64 = mmfuse.moe_unpermute(*dev(p.rows.double(), p.row_id_map, probs)).cpu()
    assert torch.equal(got64, out)
    ones = mmfuse.moe_unpermute(*dev(p.rows.double(), p.row_id_map)).cpu()  # no probs: weights 1, for K = 1 too
    assert torch.equal(ones, _reference(x, idx, None, num_out)[2])


@pytest.mark.parametrize("H", [13, 4096])
@pytest.mark.parametrize("device", DEVICES)
def test_unpermute_with_no_entries_gives_zeros(H, device):
    # a row_id_map of K = 0 rows: every token sums nothing (and no map entry may be read)
    y = torch.randn(5, H, device=device).bfloat16()
    m = torch.empty(0, 7, dtype=torch.int32, device=device)
    out = mmfuse.moe_unpermute(y, m)
    assert out.shape == (7, H) and torch.equal(out.cpu(), torch.zeros(7, H, dtype=torch.bfloat16))
    out = mmfuse.moe_unpermute(y, m, torch.rand(7, 0, device=device))
    assert torch.equal(out.cpu(), torch.zeros(7, H, dtype=torch.bfloat16))


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    for K, drop in ((1, None), (2, None), (3, 7)):
        x = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
        idx = _indices(5, K, 4, g)
        probs = torch.rand(5, K, dtype=torch.float32, generator=g)

        def f(x, probs):
            p = mmfuse.moe_permute(x, idx, 4, drop)
            return mmfuse.moe_unpermute(p.rows * 2.0, p.row_id_map, probs)

        torch.autograd.gradcheck(lambda x: f(x, probs), (x,))
        # probs: float32 by contract; check its gradient against autograd of the reference
        pr = probs.clone().requires_grad_(True)
        f(x.detach(), pr).square().sum().backward()
        pr2 = probs.double().clone().requires_grad_(True)
        rows, row_id_map, _ = _reference(x.detach(), idx, None, drop)
        out = torch.zeros(5, 6, dtype=torch.float64)
        for k in range(K):
            r = row_id_map[k]
            keep = r >= 0
            out[keep] = out[keep] + pr2[keep, k, None] * (2.0 * rows[r[keep]])
        out.square().sum().backward()
        torch.testing.assert_close(pr.grad.double(), pr2.grad, rtol=1e-5, atol=1e-6)


def test_opcheck_and_compile():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 16, generator=g)
    idx = _indices(9, 2, 8, g)
    probs = torch.rand(9, 2, generator=g)
    torch.library.opcheck(torch.ops.mmfuse.moe_plan.default, (idx, 8, 0))
    m, c, d = torch.ops.mmfuse.moe_plan(idx, 8, 0)
    torch.library.opcheck(torch.ops.mmfuse.moe_permute.default, (x.requires_grad_(True), m, d.shape[0]))
    y = torch.randn(18, 16, generator=g)
    torch.library.opcheck(torch.ops.mmfuse.moe_unpermute.default, (y.requires_grad_(True), m, probs))
    for want_dprobs in (True, False):
        torch.library.opcheck(torch.ops.mmfuse.moe_unpermute_backward.default,
                              (torch.randn(9, 16), y.detach(), m, probs, want_dprobs))

    def f(x, idx, probs):
        p = mmfuse.moe_permute(x, idx, 8)
        return mmfuse.moe_unpermute(p.rows * 3, p.row_id_map, probs)

    want = f(x.detach(), idx, probs)
    assert torch.equal(torch.compile(f, fullgraph=True)(x.detach(), idx, probs), want)


def test_bad_input():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"indices\[1\]\[0\] = 9: expected an expert id in \[0, 8\)"):
        mmfuse.moe_permute(x, torch.tensor([[0], [9]]), 8)
    with pytest.raises(ValueError, match=r"num_out_tokens: expected 0 \(all\) or in \[0, T\*K = 2\], got 5"):
        mmfuse.moe_permute(x, torch.tensor([[0], [1]]), 8, 5)
    p = mmfuse.moe_permute(x, torch.tensor([[0], [1]]), 8)
    with pytest.raises(ValueError, match="probs: expected dtype float32, got float64"):
        mmfuse.moe_unpermute(p.rows, p.row_id_map, torch.ones(2, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"probs: expected shape \[2, 1\], got \[1, 2\]"):
        mmfuse.moe_unpermute(p.rows, p.row_id_map, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"row_id_map\[0\]\[1\] = 7: expected -1 or a row"):
        mmfuse.moe_unpermute(p.rows, torch.tensor([[0, 7]], dtype=torch.int32))
    with pytest.raises(ValueError, match="row 0 is the destination of two entries"):
        torch.ops.mmfuse.moe_unpermute_backward(x, p.rows, torch.tensor([[0, 0]], dtype=torch.int32), None)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="num_experts: expected at most 4096 on CUDA, got 5000"):
            mmfuse.moe_permute(x.cuda(), torch.tensor([[0], [1]]).cuda(), 5000)
        with pytest.raises(ValueError, match="row_id_map: expected a tensor on cuda:0"):
            mmfuse.moe_unpermute(p.rows.cuda(), p.row_id_map)


_DEVICE_ERRORS = [
    ("mmfuse.moe_permute(torch.randn(3, 8).cuda(), torch.tensor([[0], [2], [9]]).cuda(), 4)",
     "moe_plan: indices[2][0] = 9: expected an expert id in [0, 4)"),
    ("mmfuse.moe_unpermute(torch.randn(4, 8).cuda(), torch.tensor([[0, 5]], dtype=torch.int32).cuda())",
     "moe_unpermute: row_id_map[0][1] = 5: expected -1 or a row in [0, 4)"),
    ("torch.ops.mmfuse.moe_unpermute_backward(torch.randn(2, 8).cuda(), torch.randn(4, 8).cuda(), "
     "torch.tensor([[1, 1]], dtype=torch.int32).cuda(), None)", "row 1 is the destination of two entries"),
    # K = 2 on 16-byte rows: the token-tile kernels (sm_90) report the same
    ("mmfuse.moe_unpermute(torch.randn(4, 8).cuda(), torch.tensor([[0, 1], [2, 9]], dtype=torch.int32).cuda())",
     "moe_unpermute: row_id_map[1][1] = 9: expected -1 or a row in [0, 4)"),
    ("torch.ops.mmfuse.moe_unpermute_backward(torch.randn(2, 8).cuda(), torch.randn(4, 8).cuda(), "
     "torch.tensor([[0, 1], [7, 2]], dtype=torch.int32).cuda(), torch.rand(2, 2).cuda())",
     "moe_unpermute_backward: row_id_map[1][0] = 7: expected -1 or a row in [0, 4)"),
    ("torch.ops.mmfuse.moe_unpermute_backward(torch.randn(2, 8).cuda(), torch.randn(4, 8).cuda(), "
     "torch.tensor([[0, 1], [2, 1]], dtype=torch.int32).cuda(), None)", "row 1 is the destination of two entries"),
]
# K = 3, a row written twice, on each path of the backward (MMFUSE_MOE_BWD): the rows' write counts
# are checked by one kernel after any of them
_DUPLICATE_K3 = ("torch.ops.mmfuse.moe_unpermute_backward(torch.randn(2, 8).cuda(), torch.randn(6, 8).cuda(), "
                 "torch.tensor([[0, 1], [2, 3], [4, 1]], dtype=torch.int32).cuda(), torch.rand(2, 3).cuda())")


@needs_gpu
@pytest.mark.parametrize("call,message,bwd", [(c, m, "auto") for c, m in _DEVICE_ERRORS] +
                         [(_DUPLICATE_K3, "row 1 is the destination of two entries", p)
                          for p in ("auto", "tile", "general", "warp", "entry")])
def test_cuda_bad_input_stops_with_a_message(call, message, bwd):
    # a device-side assertion ends the CUDA context: run it in a child process
    code = f"import torch, mmfuse\nout = {call}\ntorch.cuda.synchronize()\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MMFUSE_MOE_BWD=bwd))
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, r.stdout + r.stderr


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("K,E", [(1, 2), (2, 8), (4, 16)])
# the backward's paths (MMFUSE_MOE_BWD: auto, a warp a token at K = 1, a warp an entry at K = 2; tile;
# warp, a warp a token at K = 1; entry, a warp an entry)
@pytest.mark.parametrize("bwd", ["auto", "tile", "warp", "entry"])
def test_cuda_equals_cpu_at_model_size(dtype, K, E, bwd):
    with path_override("MMFUSE_MOE_BWD", bwd):
        _cuda_equals_cpu_at_model_size(dtype, K, E)


def _cuda_equals_cpu_at_model_size(dtype, K, E):
    g = torch.Generator().manual_seed(5)
    T, H = 4099, 2048 + 8  # odd T; rows of 16-byte vectors
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = _indices(T, K, E, g)
    probs = torch.rand(T, K, generator=g)
    want = mmfuse.moe_permute(x, idx, E, T * K - 100)
    got = mmfuse.moe_permute(x.cuda(), idx.cuda(), E, T * K - 100)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == dtype else a, b.cpu().view(torch.uint8)
               if b.dtype == dtype else b.cpu()) for a, b in zip(want, got))
    if dtype == torch.float8_e4m3fn:
        return
    y = torch.randn(want.rows.shape, generator=g).to(dtype)
    out_cpu = mmfuse.moe_unpermute(y, want.row_id_map, probs)
    out_gpu = mmfuse.moe_unpermute(y.cuda(), got.row_id_map, probs.cuda())
    assert torch.equal(out_cpu, out_gpu.cpu())  # same k order, explicit rounding: bitwise
    dout = torch.randn(T, H, generator=g).to(dtype)
    dy_c, dp_c = torch.ops.mmfuse.moe_unpermute_backward(dout, y, want.row_id_map, probs)
    runs = [torch.ops.mmfuse.moe_unpermute_backward(dout.cuda(), y.cuda(), got.row_id_map, probs.cuda())
            for _ in range(3)]
    assert torch.equal(dy_c, runs[0][0].cpu())
    torch.testing.assert_close(runs[0][1].cpu(), dp_c, rtol=1e-4, atol=1e-3)
    assert all(torch.equal(r[1], runs[0][1]) and torch.equal(r[0], runs[0][0]) for r in runs)  # deterministic


def test_path_overrides_reject_unknown_values():
    with pytest.raises(ValueError, match="MMFUSE_MOE_PLAN: expected auto, cooperative or two, got 'grid'"):
        torch.ops.mmfuse._set_path_override("MMFUSE_MOE_PLAN", "grid")
    with pytest.raises(ValueError, match="MMFUSE_MOE_PLAN_HIST: expected auto, wide or narrow, got 'int16'"):
        torch.ops.mmfuse._set_path_override("MMFUSE_MOE_PLAN_HIST", "int16")
    with pytest.raises(ValueError, match="MMFUSE_MOE_BWD: expected auto, tile, general, warp or entry, got 'warps'"):
        torch.ops.mmfuse._set_path_override("MMFUSE_MOE_BWD", "warps")
    with pytest.raises(ValueError, match="name: expected one of MMFUSE_MOE_PLAN, MMFUSE_MOE_PLAN_HIST, MMFUSE_MOE_BWD"):
        torch.ops.mmfuse._set_path_override("MMFUSE_MOE_UNPERMUTE", "auto")


def test_path_override_from_the_environment_read_at_first_use():
    """The environment variable is read once, at the first op: a bad value fails that op loudly."""
    code = "import torch, mmfuse\nmmfuse.moe_permute(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.long), 2)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MMFUSE_MOE_BWD="warps"))
    assert r.returncode == 0, r.stderr  # the CPU ops read no path override
    code = "import torch, mmfuse\ntorch.ops.mmfuse._set_path_override('MMFUSE_MOE_PLAN', 'two')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MMFUSE_MOE_BWD="warps"))
    assert r.returncode != 0 and "MMFUSE_MOE_BWD: expected auto, tile, general, warp or entry, got 'warps'" in r.stderr


@needs_gpu
def test_cuda_autograd_matches_cpu():
    g = torch.Generator().manual_seed(6)
    T, K, E, H = 333, 4, 64, 96
    x = torch.randn(T, H, generator=g)
    idx = _indices(T, K, E, g).int()
    probs = torch.rand(T, K, generator=g)
    dout = torch.randn(T, H, generator=g)
    grads = []
    for device in ("cpu", "cuda"):
        xx = x.to(device, copy=True).requires_grad_(True)
        pp = probs.to(device, copy=True).requires_grad_(True)
        p = mmfuse.moe_permute(xx, idx.to(device), E, T * K - 50)
        mmfuse.moe_unpermute(p.rows * 2 + 1, p.row_id_map, pp).backward(dout.to(device))
        grads.append((xx.grad.cpu(), pp.grad.cpu()))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-4)


@needs_gpu
def test_cuda_graph_capture_and_no_host_sync():
    g = torch.Generator().manual_seed(7)
    T, K, E, H = 2048, 2, 8, 512
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    idx = _indices(T, K, E, g).cuda()
    probs = torch.rand(T, K, generator=g).cuda()
    dout = torch.randn(T, H, generator=g).bfloat16().cuda()

    def step(x, idx, probs, dout):
        xx = x.detach().requires_grad_(True)
        pp = probs.detach().requires_grad_(True)
        p = mmfuse.moe_permute(xx, idx, E, 3000)
        out = mmfuse.moe_unpermute(p.rows, p.row_id_map, pp)
        out.backward(dout)
        return out, xx.grad, pp.grad, p.counts

    want = step(x, idx, probs, dout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x, idx, probs, dout)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(x, idx, probs, dout)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step(x, idx, probs, dout)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the graph reads its inputs at replay: route every token elsewhere, replay, compare
    idx.copy_((idx + 3) % E)
    x.mul_(-1)
    want2 = step(x, idx, probs, dout)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(want2[3], want[3])
    assert all(torch.equal(a, b) for a, b in zip(got, want2))


@needs_gpu
@pytest.mark.parametrize("T,K,E", [(32768, 2, 64), (65536, 1, 2), (4096, 8, 384), (4096, 8, 1024)])
def test_cuda_plan_sees_the_ids_the_work_before_it_wrote(T, K, E):
    # On sm_90+ the plan's kernels are programmatic dependent launches, whose blocks may start
    # before the work ahead of them in the stream ends: each plan must still read the ids that work
    # wrote. Writers: a copy after a sleep, a kernel, nothing (the first node of a graph), and
    # another plan; in a stream and captured in a CUDA graph, replayed with new ids.
    g = torch.Generator().manual_seed(T + K + E)
    srcs = [_indices(T, K, E, g).cuda() for _ in range(3)]
    idx = torch.empty_like(srcs[0])
    shift = torch.zeros((), dtype=idx.dtype, device="cuda")
    ops = torch.ops.mmfuse

    def step():
        torch.cuda._sleep(100000)
        idx.copy_(srcs[0])
        a = ops.moe_plan(idx, E, 0)
        torch.remainder(idx + shift, E, out=idx)  # a kernel writes the ids
        b = ops.moe_plan(idx, E, 0)
        c = ops.moe_plan(srcs[1], E, 0)  # right after another plan
        return a, b, c

    def check(got, ids):
        torch.cuda.synchronize()
        for plan, i in zip(got, ids):
            want = ops.moe_plan(i.cpu(), E, 0)
            assert all(torch.equal(x.cpu(), y) for x, y in zip(plan, want))

    check(step(), [srcs[0], srcs[0], srcs[1]])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        first = ops.moe_plan(srcs[2], E, 0)  # the graph's first node
        got = step()
    for n in range(1, 4):
        srcs[0].copy_(torch.roll(srcs[0], 1, 0))
        srcs[1].copy_((srcs[1] + n) % E)
        srcs[2].copy_(torch.flip(srcs[2], [0]))
        shift.fill_(n)
        graph.replay()
        check((first,) + got, [srcs[2], srcs[0], (srcs[0] + n) % E, srcs[1]])


@needs_gpu
def test_cuda_compile_fullgraph():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(100, 64, generator=g).cuda()
    idx = _indices(100, 2, 8, g).cuda()
    probs = torch.rand(100, 2, generator=g).cuda()

    def f(x, idx, probs):
        p = mmfuse.moe_permute(x, idx, 8)
        return mmfuse.moe_unpermute(p.rows.relu(), p.row_id_map, probs)

    assert torch.equal(torch.compile(f, fullgraph=True)(x, idx, probs), f(x, idx, probs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seed_permute_on_cuda_equals_native():
    # no expert count (a stable sort of the ids, no host sync): the same rows and map as with the count
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, generator=g).cuda()
    idx = _indices(300, 4, 37, g).cuda()
    p = mmfuse.moe_permute(x, idx, 37)
    rows, row_id_map, _ = backend.permute(x, idx, 0, None, 0)
    assert torch.equal(rows, p.rows) and torch.equal(row_id_map, p.row_id_map)
    rows, row_id_map, _ = backend.permute(x, idx, 1000, None, 0)  # the first 1000 rows of the order
    q = mmfuse.moe_permute(x, idx, 37, 1000)
    assert torch.equal(rows, q.rows) and torch.equal(row_id_map, q.row_id_map)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,K,E,n", [(1, 1, 1, 0), (37, 1, 3, 0), (300, 4, 37, 0), (300, 4, 37, 1000), (65, 8, 256, 7),
                                     (64, 2, 5, 128), (1000, 8, 4096, 0)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sort_plan_equals_the_plan(device, T, K, E, n, dtype):
    # the expert-count-free order (the seed permute's: a radix sort of the ids) is the counting sort's
    g = torch.Generator().manual_seed(T * K + n)
    idx = _indices(T, K, E, g).to(dtype).to(device)
    want = torch.ops.mmfuse.moe_plan(idx, E, n)[0]
    got = torch.ops.mmfuse.moe_sort_plan(idx, n)
    assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, want)
    idx = torch.randint(0, E, (T, K), generator=g, dtype=dtype).to(device)  # repeats: ties keep (t, k) order
    assert torch.equal(torch.ops.mmfuse.moe_sort_plan(idx, n), torch.ops.mmfuse.moe_plan(idx, E, n)[0])
    # a strided (transposed) view of the ids, as a router's topk output can be
    idx_t = idx.t().contiguous().t()
    assert torch.equal(torch.ops.mmfuse.moe_sort_plan(idx_t, n), torch.ops.mmfuse.moe_plan(idx, E, n)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_sort_plan_takes_ids_past_the_plans_expert_limit(device):
    # no expert count, so no bound below 2^31: large and sparse ids keep the stable order
    ids = torch.tensor([[2 ** 31 - 1, 7], [5000, 7], [0, 2 ** 20]], dtype=torch.int64, device=device)
    want = torch.tensor([[5, 3, 0], [1, 2, 4]], dtype=torch.int32)  # [K, T]: 0, 7 (t 0), 7 (t 1), 5000, 2^20, 2^31-1
    assert torch.equal(torch.ops.mmfuse.moe_sort_plan(ids, 0).cpu(), want)
    assert torch.equal(torch.ops.mmfuse.moe_sort_plan(ids, 4).cpu(), torch.where(want < 4, want, -1))


def test_sort_plan_rejects_bad_input():
    idx = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"mmfuse.moe_sort_plan: num_out_tokens: expected 0 \(all\) or in \[0, "
                                         r"T\*K = 8\], got 9"):
        torch.ops.mmfuse.moe_sort_plan(idx, 9)
    with pytest.raises(ValueError, match=r"mmfuse.moe_sort_plan: indices\[0\]\[1\] = -1: expected an expert id "
                                         r"in \[0, 2\^31\)"):
        torch.ops.mmfuse.moe_sort_plan(torch.tensor([[0, -1]], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"indices\[1\]\[0\] = 2147483648: expected an expert id"):
        torch.ops.mmfuse.moe_sort_plan(torch.tensor([[0], [2 ** 31]]), 0)
    with pytest.raises(ValueError, match="indices: expected dtype int32 or int64, got float32"):
        torch.ops.mmfuse.moe_sort_plan(torch.zeros(4, 2), 0)
    with pytest.raises(ValueError, match=r"indices: expected shape \[N, H\], got \[8\]"):
        torch.ops.mmfuse.moe_sort_plan(torch.zeros(8, dtype=torch.int32), 0)
    assert torch.ops.mmfuse.moe_sort_plan(torch.zeros(0, 2, dtype=torch.int32), 0).shape == (2, 0)
    with pytest.raises(ValueError, match="backend.permute: indices: expected a tensor on"):
        backend.permute(torch.zeros(2, 4, device="meta"), torch.zeros(2, 1, dtype=torch.int32), 0, None, 0)


def test_sort_plan_opcheck():
    g = torch.Generator().manual_seed(3)
    for n in (0, 5):
        torch.library.opcheck(torch.ops.mmfuse.moe_sort_plan, (_indices(7, 2, 5, g), n))


def test_seed_backend_functions():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 8, generator=g)
    idx = _indices(6, 2, 4, g).to(torch.int32)
    probs = torch.rand(6, 2, generator=g)
    ws = torch.empty(0)
    rows, row_id_map, ws2 = backend.permute(x, idx, 0, ws, 0)
    assert ws2 is ws
    p = mmfuse.moe_permute(x, idx, 4)
    assert torch.equal(rows, p.rows) and torch.equal(row_id_map, p.row_id_map)
    out = backend.unpermute(rows, row_id_map.reshape(-1), probs, 6, 2)
    assert torch.equal(out, mmfuse.moe_unpermute(rows, row_id_map, probs))
    dout = torch.randn(6, 8, generator=g)
    dy, dprob = backend.unpermute_bwd(dout, rows, row_id_map.reshape(-1), probs)
    y = rows.clone().requires_grad_(True)
    pr = probs.clone().requires_grad_(True)
    mmfuse.moe_unpermute(y, row_id_map, pr).backward(dout)
    assert torch.equal(dy, y.grad) and torch.equal(dprob, pr.grad)
    # K = 1 without probabilities: gradient of the weights still defined (the seed left it uninitialised)
    p1 = mmfuse.moe_permute(x, idx[:, :1], 4)
    dy1, dprob1 = backend.unpermute_bwd(dout, p1.rows, p1.row_id_map, None)
    assert torch.equal(dy1[p1.row_id_map[0].long()], dout)  # dy[row(t)] = dout[t]
    assert torch.allclose(dprob1[:, 0], (dout * x).sum(1))
