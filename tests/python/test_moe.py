"""MoE routing ops (CPU; the CUDA backend is issue 4's next step) against a float64 reference (stable
argsort + gather + weighted sum): K in {1, 2, 4, 8}, E in {2, 8, 64, 256}, dropping, T = 0 and 1, odd
H; gradcheck, opcheck, torch.compile, bad input, the seed's backend functions."""

import pytest
import torch

import mmfuse
from mmfuse import backend


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
def test_against_float64_reference(K, E, T, drop):
    g = torch.Generator().manual_seed(T * 1000 + K * 10 + E)
    H = 13
    x = torch.randn(T, H, generator=g)
    idx = _indices(T, K, E, g).to(torch.int32 if K % 2 else torch.int64)
    probs = torch.rand(T, K, generator=g)
    num_out = (T * K * 3) // 4 if drop else None
    p = mmfuse.moe_permute(x, idx, E, num_out)
    rows, row_id_map, out = _reference(x, idx, probs, num_out)
    assert torch.equal(p.rows.double(), rows) and torch.equal(p.row_id_map.long(), row_id_map)
    assert torch.equal(p.counts, torch.bincount(idx.reshape(-1).long()[torch.argsort(idx.reshape(-1).long(),
                                                stable=True)[:num_out or T * K]], minlength=E))
    got = mmfuse.moe_unpermute(p.rows, p.row_id_map, probs)
    torch.testing.assert_close(got.double(), out, rtol=1e-6, atol=1e-6)
    # float64 inputs: the same k order, so exact
    got64 = mmfuse.moe_unpermute(p.rows.double(), p.row_id_map, probs)
    assert torch.equal(got64, out)
    ones = mmfuse.moe_unpermute(p.rows.double(), p.row_id_map)  # no probs: weights 1, for K = 1 too
    assert torch.equal(ones, _reference(x, idx, None, num_out)[2])


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
    torch.library.opcheck(torch.ops.mmfuse.moe_permute.default, (x.requires_grad_(True), m, d))
    y = torch.randn(18, 16, generator=g)
    torch.library.opcheck(torch.ops.mmfuse.moe_unpermute.default, (y.requires_grad_(True), m, probs))
    torch.library.opcheck(torch.ops.mmfuse.moe_unpermute_backward.default, (torch.randn(9, 16), y.detach(), m, probs))

    def f(x, idx, probs):
        p = mmfuse.moe_permute(x, idx, 8)
        return mmfuse.moe_unpermute(p.rows * 3, p.row_id_map, probs)

    want = f(x.detach(), idx, probs)
    assert torch.equal(torch.compile(f, fullgraph=True)(x.detach(), idx, probs), want)


def test_bad_input():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"indices\[1\]\[0\] = 9: expected an expert id in \[0, 8\)"):
        mmfuse.moe_permute(x, torch.tensor([[0], [9]]), 8)
    with pytest.raises(ValueError, match="num_out_tokens"):
        mmfuse.moe_permute(x, torch.tensor([[0], [1]]), 8, 5)
    with pytest.raises(ValueError, match="probs: expected dtype float32"):
        p = mmfuse.moe_permute(x, torch.tensor([[0], [1]]), 8)
        mmfuse.moe_unpermute(p.rows, p.row_id_map, torch.ones(2, 1, dtype=torch.float64))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA backend of the MoE routing is not built yet"):
            mmfuse.moe_permute(x.cuda(), torch.tensor([[0], [1]]).cuda(), 8)


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
