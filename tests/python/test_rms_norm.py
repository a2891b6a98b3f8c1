"""Residual add + RMSNorm against HF's Qwen2 RMSNorm code (bitwise on the CPU where the statistics agree,
close otherwise), a float64 reference and gradcheck; the grouping against an explicit reordering;
opcheck, torch.compile, CUDA graphs with no host sync, CUDA against the CPU; bad input."""

import pytest
import torch
import torch.nn.functional as F

import mmfuse

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _hf(x, residual, weight, eps):
    """HF's decoder: h = residual + x in the dtype, then Qwen2RMSNorm."""
    h = x if residual is None else residual + x
    hs = h.to(torch.float32)
    var = hs.pow(2).mean(-1, keepdim=True)
    hs = hs * torch.rsqrt(var + eps)
    return weight * hs.to(h.dtype), h


def _grouped_index(T, L, S):
    """rows of the grouped order: grouped[i] = natural[idx[i]]"""
    t = torch.arange(T)
    b, l = t // L, t % L
    row = torch.where(l < S, b * S + l, (T // L) * S + b * (L - S) + (l - S))
    idx = torch.empty_like(row)
    idx[row] = t
    return idx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 37, 64), (3, 11, 2048), (5, 7, 33)])
def test_matches_hf(device, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(device, dtype)
    res = torch.randn(shape, generator=g).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    out, h = mmfuse.rms_norm(x, w, 1e-6, res)
    want_out, want_h = _hf(x, res, w, 1e-6)
    assert torch.equal(h, want_h)  # the residual add: bitwise
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, want_out, **tol)
    assert mmfuse.rms_norm(x, w, 1e-6).shape == shape


@pytest.mark.parametrize("device", DEVICES)
def test_grad_matches_float64(device):
    g = torch.Generator().manual_seed(3)
    T, H = 45, 96
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    res = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = 1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    gout = torch.randn(T, H, generator=g, dtype=torch.float64)
    gh = torch.randn(T, H, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (x, res, w)]
    o, hh = _hf(ref[0], ref[1], ref[2], 1e-6)
    ((o * gout).sum() + (hh * gh).sum()).backward()
    dt = torch.float32
    ins = [t.to(device, dt).requires_grad_() for t in (x, res, w)]
    o, hh = mmfuse.rms_norm(ins[0], ins[2], 1e-6, ins[1])
    ((o * gout.to(device, dt)).sum() + (hh * gh.to(device, dt)).sum()).backward()
    for got, want in zip(ins, ref):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=1e-4, atol=1e-4)


def test_gradcheck_float64_cpu():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 10, generator=g, dtype=torch.float64, requires_grad=True)
    res = torch.randn(12, 10, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: mmfuse.rms_norm(a, c, 1e-5, b), (x, res, w))
    assert torch.autograd.gradcheck(lambda a, c: mmfuse.rms_norm(a, c, 1e-5, grouping=(4, 1), x_grouped=True,
                                                                 out_grouped=True), (x, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("xg,og,residual", [(False, True, True), (True, False, True), (True, True, True),
                                             (True, False, False)])
def test_grouping_is_a_fused_reorder(device, xg, og, residual):
    g = torch.Generator().manual_seed(5)
    B, L, S, H = 3, 10, 7, 48
    T = B * L
    idx = _grouped_index(T, L, S).to(device)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16).requires_grad_()
    res = torch.randn(T, H, generator=g).to(device, torch.bfloat16).requires_grad_() if residual else None
    w = torch.randn(H, generator=g).to(device, torch.bfloat16).requires_grad_()
    r = mmfuse.rms_norm(x, w, 1e-6, res, grouping=(L, S), x_grouped=xg, out_grouped=og)
    out, h = r if residual else (r, None)
    x_nat = torch.empty_like(x).index_copy_(0, idx, x) if xg else x  # x_nat[t] = x[g(t)]
    r2 = mmfuse.rms_norm(x_nat, w, 1e-6, res)
    out2, h2 = r2 if residual else (r2, None)
    assert torch.equal(out, out2[idx] if og else out2)
    if residual:
        assert torch.equal(h, h2)
    gout = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    grads = torch.autograd.grad(out, [x, w] + ([res] if residual else []), gout)
    x2 = x.detach().clone().requires_grad_()
    x2_nat = torch.empty_like(x2).index_copy_(0, idx, x2) if xg else x2
    r3 = mmfuse.rms_norm(x2_nat, w, 1e-6, res)
    out3 = r3[0] if residual else r3
    grads2 = torch.autograd.grad(out3[idx] if og else out3, [x2, w] + ([res] if residual else []), gout)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


def test_opcheck_and_compile():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 16, generator=g, requires_grad=True)
    res = torch.randn(12, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.mmfuse.rms_norm.default, (x, res, w, 1e-6, 0, 0, False, False))
    torch.library.opcheck(torch.ops.mmfuse.rms_norm.default, (x, None, w, 1e-6, 4, 3, True, True))
    out, h, rstd = torch.ops.mmfuse.rms_norm(x, res, w, 1e-6)
    torch.library.opcheck(torch.ops.mmfuse.rms_norm_backward.default,
                          (torch.randn_like(out), torch.randn_like(h), h.detach(), rstd.detach(), w.detach(), 4, 3, True, False))
    fn = torch.compile(lambda a, b, c: mmfuse.rms_norm(a, c, 1e-6, b, grouping=(4, 1), out_grouped=True),
                       fullgraph=True)
    got = fn(x, res, w)
    want = mmfuse.rms_norm(x, w, 1e-6, res, grouping=(4, 1), out_grouped=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_gpu
def test_cuda_matches_cpu_and_graph_capture():
    g = torch.Generator().manual_seed(7)
    T, H = 4096, 2048
    x = torch.randn(T, H, generator=g).bfloat16()
    res = torch.randn(T, H, generator=g).bfloat16()
    w = torch.randn(H, generator=g).bfloat16()
    out_c, h_c = mmfuse.rms_norm(x, w, 1e-6, res, grouping=(1024, 768), out_grouped=True)
    xs, rs, ws = x.cuda(), res.cuda(), w.cuda()
    out_g, h_g = mmfuse.rms_norm(xs, ws, 1e-6, rs, grouping=(1024, 768), out_grouped=True)
    assert torch.equal(h_g.cpu(), h_c)
    assert (out_g.cpu().float() - out_c.float()).abs().max() <= 2 ** -7 * out_c.float().abs().max()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mmfuse.rms_norm(xs, ws, 1e-6, rs)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            o2, h2 = mmfuse.rms_norm(xs, ws, 1e-6, rs)
            dx, dres, dw = torch.ops.mmfuse.rms_norm_backward(o2, h2, h2, torch.ones(T, device="cuda"), ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h2, h_g)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    x = torch.randn(4, 6, device=device)
    w = torch.randn(6, device=device)
    with pytest.raises(ValueError, match=r"mmfuse.rms_norm: weight: expected shape \[6\], got \[5\]"):
        mmfuse.rms_norm(x, w[:5])
    with pytest.raises(ValueError, match="residual: expected dtype float32, got bfloat16"):
        mmfuse.rms_norm(x, w, 1e-6, x.bfloat16())
    with pytest.raises(ValueError, match="seq_len: expected a divisor of the 4 tokens, got 3"):
        mmfuse.rms_norm(x, w, grouping=(3, 1), out_grouped=True)
    with pytest.raises(ValueError, match="eps: expected a finite value >= 0, got nan"):
        mmfuse.rms_norm(x, w, float("nan"))
    with pytest.raises(ValueError, match=r"x: expected \[..., H\], got a 0-d tensor"):
        mmfuse.rms_norm(x[0, 0], w)


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_inputs_read_as_given(device):
    # a broadcast x or residual (stride-0 rows) is read, not refused; gradients flow back through the expand
    g = torch.Generator().manual_seed(4)
    row, res_row = (torch.randn(1, 24, generator=g).to(device).requires_grad_() for _ in range(2))
    w = torch.randn(24, generator=g).to(device)
    out, h = mmfuse.rms_norm(row.expand(5, 24), w, 1e-6, res_row.expand(5, 24))
    (out.square().sum() + h.sum()).backward()
    row2, res2 = row.detach().clone().requires_grad_(), res_row.detach().clone().requires_grad_()
    h2 = row2.expand(5, 24) + res2.expand(5, 24)
    out2 = F.rms_norm(h2, (24,), w, 1e-6)
    (out2.square().sum() + h2.sum()).backward()
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row.grad, row2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res_row.grad, res2.grad, rtol=1e-5, atol=1e-5)
    assert mmfuse.rms_norm(torch.ones(3, 0, device=device), w[:0]).shape == (3, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_inputs_give_hfs_results(device):
    """The rule: an Inf or NaN in a row gives what HF's formula gives (an Inf makes the row's mean square
    Inf, so its finite entries normalize to 0 and the Inf to NaN; a NaN makes the row NaN); other rows
    are untouched."""
    x = torch.tensor([[1.0, float("inf"), 2.0, 0.5], [1.0, float("nan"), 2.0, 0.5], [1.0, 2.0, 3.0, 4.0]],
                     device=device)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0], device=device)
    res = torch.zeros_like(x)
    out, h = mmfuse.rms_norm(x, w, 1e-6, res)
    want, want_h = _hf(x, res, w, 1e-6)
    torch.testing.assert_close(out, want, equal_nan=True)
    torch.testing.assert_close(h, want_h, equal_nan=True)


def test_unused_outputs_get_no_zero_filled_gradient(record_ops):
    # the last layer's new residual (and rstd, always) unused: no [T, H] zero "gradient" made for it
    g = torch.Generator().manual_seed(4)
    T, H = 37, 64
    x, r = (torch.randn(T, H, generator=g).requires_grad_() for _ in range(2))
    w = torch.randn(H, generator=g).requires_grad_()
    y, h, _ = torch.ops.mmfuse.rms_norm(x, r, w, 1e-6)
    dy = torch.randn(T, H, generator=g)
    with record_ops() as rec:
        y.backward(dy)
    assert rec.fills_of(T) == [], rec.ops
    hs = (x + r).detach().double().requires_grad_()
    ref = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6) * w.detach().double()
    (gh,) = torch.autograd.grad(ref, hs, dy.double())
    torch.testing.assert_close(x.grad.double(), gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.grad, x.grad)
