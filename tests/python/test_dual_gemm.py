"""Dual-expert GEMM on the CPU (ATen's matmul) and CUDA (cuBLASLt) against float64: all four layouts,
m in {0, 1, 7, 128}, odd and aligned n and k (up to a model's 2752), bf16 / fp16 / fp32, fp32
outputs, accumulation; gradcheck in float64, gradients of bf16 inputs (CPU and CUDA), opcheck,
torch.compile, CUDA graphs, bad input, the seed function."""

import pytest
import torch

import mmfuse
from mmfuse import backend

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _op(t, trans):
    return t.t() if trans else t


def _make(m, n, k, ta, tb, dtype, g):
    a = torch.randn((k, m) if ta else (m, k), generator=g).to(dtype)
    w = torch.randn((n, k) if tb else (k, n), generator=g).to(dtype)
    return a, w


def _bound(a, w, ta, tb, out_dtype):
    """|fp32-accumulated result - float64| bound: k fp32 roundings of the running sum, then one
    rounding of the output."""
    A, W = _op(a, ta).double(), _op(w, tb).double()
    k = A.shape[1]
    mag = A.abs() @ W.abs()
    eps_out = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[out_dtype]
    return A @ W, (k + 2) * 2 ** -23 * mag + eps_out * (A @ W).abs() + 1e-30


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shapes", [((7, 33, 19), (1, 8, 64)), ((128, 64, 40), (0, 24, 17)),
                                    ((0, 5, 3), (128, 17, 64)), ((16, 48, 0), (3, 9, 11)),
                                    ((33, 40, 2752), (5, 24, 1024))])
@pytest.mark.parametrize("device", DEVICES)
def test_against_float64(ta, tb, dtype, shapes, device):
    g = torch.Generator().manual_seed(hash((ta, tb, str(dtype), shapes)) % 2 ** 31)
    (a0, w0), (a1, w1) = (_make(*s, ta, tb, dtype, g) for s in shapes)
    dev = [t.to(device) for t in (a0, w0, a1, w1)]
    for out_dtype in (None, torch.float32):
        outs = mmfuse.dual_gemm(*dev, ta, tb, out_dtype=out_dtype)
        for out, a, w, (m, n, _) in zip(outs, (a0, a1), (w0, w1), shapes):
            assert out.shape == (m, n) and out.dtype == (out_dtype or dtype) and out.device.type == device
            ref, tol = _bound(a, w, ta, tb, out.dtype)
            assert bool(((out.cpu().double() - ref).abs() <= tol).all())
    # accumulation into fp32 buffers
    bufs = [torch.randn(s[0], s[1], generator=g) for s in shapes]
    before = [b.clone() for b in bufs]
    dbufs = [b.to(device) for b in bufs]
    mmfuse.dual_gemm_out(*dev, dbufs[0], dbufs[1], ta, tb, accumulate=True)
    bufs = [b.cpu() for b in dbufs]
    for b, b0, a, w in zip(bufs, before, (a0, a1), (w0, w1)):
        ref, tol = _bound(a, w, ta, tb, torch.float32)
        assert bool(((b.double() - b0.double() - ref).abs() <= tol + 2 ** -23 * b0.double().abs()).all())


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_gradcheck_float64(ta, tb):
    g = torch.Generator().manual_seed(int(ta) * 2 + int(tb))
    (a0, w0), (a1, w1) = _make(5, 3, 4, ta, tb, torch.float64, g), _make(2, 6, 3, ta, tb, torch.float64, g)
    args = [t.requires_grad_(True) for t in (a0, w0, a1, w1)]
    torch.autograd.gradcheck(lambda *x: mmfuse.dual_gemm(*x, ta, tb), args)
    # only some inputs needing gradients, and an unused output
    a0.grad = None
    w1.requires_grad_(False)
    out0, _ = mmfuse.dual_gemm(a0, w0.detach(), a1.detach(), w1, ta, tb)
    out0.sum().backward()
    torch.testing.assert_close(a0.grad, torch.autograd.grad((_op(a0, ta) @ _op(w0.detach(), tb)).sum(), a0)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_gradients_match_float64(device):
    g = torch.Generator().manual_seed(3)
    a0, w0 = _make(64, 96, 80, False, True, torch.bfloat16, g)
    a1, w1 = _make(8, 40, 48, False, True, torch.bfloat16, g)
    ins = [t.to(device, copy=True).requires_grad_(True) for t in (a0, w0, a1, w1)]
    outs = mmfuse.dual_gemm(*ins, False, True, out_dtype=torch.float32)
    douts = [torch.randn(o.shape, generator=g) for o in outs]
    torch.autograd.backward(outs, [d.to(device) for d in douts])
    ref_ins = [t.double().requires_grad_(True) for t in (a0, w0, a1, w1)]
    ref = (ref_ins[0] @ ref_ins[1].t(), ref_ins[2] @ ref_ins[3].t())
    # the gradients' products take dout rounded to bf16 (the inputs' dtype)
    torch.autograd.backward(ref, [d.bfloat16().double() for d in douts])
    for got, want in zip(ins, ref_ins):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=2 ** -7, atol=0.05)


def test_opcheck_compile_and_seed_function():
    g = torch.Generator().manual_seed(4)
    (a0, w0), (a1, w1) = _make(9, 16, 8, False, False, torch.float32, g), _make(3, 5, 8, False, False, torch.float32, g)
    for ta, tb in ((False, False), (True, True)):
        args = (a0.t().contiguous() if ta else a0, w0.t().contiguous() if tb else w0,
                a1.t().contiguous() if ta else a1, w1.t().contiguous() if tb else w1)
        torch.library.opcheck(torch.ops.mmfuse.dual_gemm.default,
                              tuple(t.clone().requires_grad_(True) for t in args) + (ta, tb, False))
    torch.library.opcheck(torch.ops.mmfuse.dual_gemm_out.default,
                          (a0, w0, a1, w1, torch.empty(9, 16), torch.empty(3, 5), False, False, False))

    def f(a0, w0, a1, w1):
        o0, o1 = mmfuse.dual_gemm(a0, w0, a1, w1)
        return o0.relu(), o1 * 2

    want = f(a0, w0, a1, w1)
    got = torch.compile(f, fullgraph=True)(a0, w0, a1, w1)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    # the seed's function: allocated outputs, or given (contiguous) ones written in place
    o = backend.asym_dual_gmm_separated(a0, a1, w0, w1)
    assert all(torch.equal(x, y) for x, y in zip(o, mmfuse.dual_gemm(a0, w0, a1, w1)))
    out0, out1 = torch.empty(9, 16), torch.empty(3, 5)
    r = backend.asym_dual_gmm_separated(a0, a1, w0, w1, out0, out1)
    assert r[0] is out0 and r[1] is out1 and torch.equal(out0, o[0]) and torch.equal(out1, o[1])
    with pytest.raises(ValueError, match=r"out0: expected a contiguous tensor \(outputs are written in place\)"):
        backend.asym_dual_gmm_separated(a0, a1, w0, w1, torch.empty(16, 9).t(), out1)


def test_bad_input():
    a, w = torch.randn(6, 4).bfloat16(), torch.randn(4, 5).bfloat16()
    with pytest.raises(ValueError, match=r"w1: expected 4 along its k dim \(that of a1; trans_a=False, trans_b=False\)"):
        mmfuse.dual_gemm(a, w, a, torch.randn(5, 4).bfloat16())
    with pytest.raises(ValueError, match="a1: expected dtype bfloat16 \\(that of a0\\), got float32"):
        mmfuse.dual_gemm(a, w, a.float(), w)
    with pytest.raises(ValueError, match="accumulate=True needs a float32 output, got bfloat16"):
        mmfuse.dual_gemm_out(a, w, a, w, torch.empty(6, 5).bfloat16(), torch.empty(6, 5).bfloat16(), accumulate=True)
    with pytest.raises(ValueError, match="out_dtype"):
        mmfuse.dual_gemm(a, w, a, w, out_dtype=torch.float16)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="w1: expected a tensor on cuda:0 \\(that of a0\\), got cpu"):
            mmfuse.dual_gemm(a.cuda(), w.cuda(), a.cuda(), w)
        with pytest.raises(ValueError, match="float64 is CPU only"):
            mmfuse.dual_gemm(*(t.double().cuda() for t in (a, w, a, w)))


@needs_gpu
def test_cuda_graph_capture_and_no_host_sync():
    """Captured and replayed twice, with no host sync."""
    g = torch.Generator().manual_seed(9)
    (a0, w0), (a1, w1) = _make(512, 384, 256, False, True, torch.bfloat16, g), _make(64, 128, 256, False, True,
                                                                                     torch.bfloat16, g)
    ins = [t.cuda() for t in (a0, w0, a1, w1)]
    want = mmfuse.dual_gemm(*ins, False, True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mmfuse.dual_gemm(*ins, False, True)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = mmfuse.dual_gemm(*ins, False, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    ins[0].mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], mmfuse.dual_gemm(*ins, False, True)[0])


# ---- mmfuse.nn.DualExpertMLP ----------------------------------------------------------------------

class _SwiGLU(torch.nn.Module):
    """The plain PyTorch expert the module is checked against (HF's LlamaMLP / Qwen2MLP shape)."""

    def __init__(self, h, i, dtype):
        super().__init__()
        self.gate_proj = torch.nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _experts(hidden, inter, dtype, seed):
    torch.manual_seed(seed)
    ref = [_SwiGLU(h, i, dtype) for h, i in zip(hidden, inter)]
    return ref, mmfuse.nn.DualExpertMLP.from_mlps(*ref)


@pytest.mark.parametrize("m", [(37, 5), (0, 9), (6, 0), (1, 1)])
def test_dual_expert_mlp_separate_streams_float64(m):
    """Different hidden and intermediate sizes; forward and every gradient against two nn.Linear
    experts in float64 (exact up to summation order)."""
    ref, mod = _experts((24, 16), (40, 12), torch.float64, seed=sum(m))
    x0 = torch.randn(m[0], 24, dtype=torch.float64, requires_grad=True)
    x1 = torch.randn(m[1], 16, dtype=torch.float64, requires_grad=True)
    y0, y1 = mod.forward_experts(x0, x1)
    r0, r1 = ref[0](x0), ref[1](x1)
    torch.testing.assert_close(y0, r0)
    torch.testing.assert_close(y1, r1)
    g0, g1 = torch.randn_like(r0), torch.randn_like(r1)
    got = torch.autograd.grad((y0, y1), (x0, x1, mod.gate_up0, mod.down0, mod.gate_up1, mod.down1), (g0, g1))
    want = torch.autograd.grad((r0, r1), [x0, x1] + [p for r in ref for p in r.parameters()], (g0, g1),
                               allow_unused=True)
    want = [w if w is not None else torch.zeros_like(p) for w, p in
            zip(want, [x0, x1] + [p for r in ref for p in r.parameters()])]
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for e in range(2):  # gate_up = [gate; up]
        gate, up, down = want[2 + 3 * e: 5 + 3 * e]
        torch.testing.assert_close(got[2 + 2 * e], torch.cat([gate, up]))
        torch.testing.assert_close(got[3 + 2 * e], down)


def test_dual_expert_mlp_gradcheck():
    _, mod = _experts((6, 4), (5, 3), torch.float64, seed=1)
    names = ("gate_up0", "down0", "gate_up1", "down1")

    class Experts(torch.nn.Module):  # forward = forward_experts, for functional_call
        def __init__(self):
            super().__init__()
            self.m = mod

        def forward(self, x0, x1):
            return self.m.forward_experts(x0, x1)

    def f(x0, x1, *w):
        return torch.func.functional_call(Experts(), {f"m.{n}": t for n, t in zip(names, w)}, (x0, x1))

    x0 = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    x1 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    ws = tuple(getattr(mod, n).detach().clone().requires_grad_(True) for n in names)
    torch.autograd.gradcheck(f, (x0, x1) + ws)


@pytest.mark.parametrize("device", DEVICES)
def test_dual_expert_mlp_mixed_sequence(device):
    """A mixed sequence routed by token type (moe_permute top-1 of 2) against running each token through
    its expert; bf16 on the device against the float64 experts of the same bf16 weights."""
    ref, mod = _experts((32, 32), (48, 24), torch.float64, seed=7)
    T = 29
    g = torch.Generator().manual_seed(5)
    token_type = (torch.rand(T, generator=g) < 0.3).long()  # ~30 % action tokens, interleaved
    x = torch.randn(T, 32, generator=g, dtype=torch.float64)
    want = torch.where(token_type[:, None] == 0, ref[0](x), ref[1](x))
    torch.testing.assert_close(mod(x, token_type), want)
    m0 = int((token_type == 0).sum())
    torch.testing.assert_close(mod(x, token_type, num_tokens0=m0), want)
    torch.testing.assert_close(mod(x, token_type.bool()), want)  # an "is action" mask
    with pytest.raises(ValueError, match="token_type: expected int32, int64 or bool, got torch.float32"):
        mod(x, token_type.float())
    # bf16 on the device, gradients included
    modb = mmfuse.nn.DualExpertMLP((32, 32), (48, 24), device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in modb.named_parameters():
            p.copy_(getattr(mod, name))
    wref = {n: p.detach().to(device, torch.bfloat16).double().requires_grad_(True) for n, p in modb.named_parameters()}

    def expert(xx, e):
        gu = xx @ wref[f"gate_up{e}"].t()
        i = gu.shape[1] // 2
        return (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ wref[f"down{e}"].t()

    xb = x.to(device, torch.bfloat16).requires_grad_(True)
    tt = token_type.to(device)
    out = modb(xb, tt, num_tokens0=m0)
    assert out.dtype == torch.bfloat16 and out.shape == (T, 32)
    xd = xb.detach().double().requires_grad_(True)
    wantb = torch.where(tt[:, None] == 0, expert(xd, 0), expert(xd, 1))
    torch.testing.assert_close(out.double(), wantb, rtol=0.03, atol=0.03)
    gout = torch.randn(T, 32, generator=g).to(device, torch.bfloat16)
    out.backward(gout)
    wantb.backward(gout.double())
    torch.testing.assert_close(xb.grad.double(), xd.grad, rtol=0.05, atol=0.05)
    for n, p in modb.named_parameters():
        torch.testing.assert_close(p.grad.double(), wref[n].grad, rtol=0.05, atol=0.05)


def test_dual_expert_mlp_compile_and_bad_input():
    _, mod = _experts((16, 16), (24, 8), torch.float32, seed=3)
    x = torch.randn(2, 11, 16)
    tt = torch.tensor([[0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0]] * 2)
    m0 = int((tt == 0).sum())
    want = mod(x, tt)
    got = torch.compile(lambda a, b: mod(a, b, num_tokens0=m0), fullgraph=True)(x, tt)
    torch.testing.assert_close(got, want)
    assert got.shape == x.shape
    with pytest.raises(ValueError, match=r"x: expected last dim 16 \(hidden_sizes\[0\]\), got shape \(3, 8\)"):
        mod(torch.randn(3, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_type: expected shape \(3,\)"):
        mod(torch.randn(3, 16), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="expected dtype torch.float32 on cpu .the parameters'., got torch.float64"):
        mod.forward_experts(torch.randn(2, 16, dtype=torch.float64), torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"num_tokens0: expected a count in \[0, 3\], got 5"):
        mod(torch.randn(3, 16), torch.zeros(3, dtype=torch.long), num_tokens0=5)
    with pytest.raises(ValueError, match="needs one width"):
        mmfuse.nn.DualExpertMLP((16, 8), (4, 4))(torch.randn(3, 16), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mmfuse.moe_plan: indices\[2\]\[0\] = 2: expected an expert id in \[0, 2\)"):
        mod(torch.randn(3, 16), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="num_tokens0 differs"):
        mod(torch.randn(3, 16), torch.tensor([0, 1, 1]), num_tokens0=2)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_of_sum_with_an_empty_expert(device):
    """The gradients autograd hands in may be expanded (stride 0, as from sum()) or empty."""
    g = torch.Generator().manual_seed(11)
    for ta, tb in ((False, True), (True, False)):
        (a0, w0), (a1, w1) = _make(9, 12, 8, ta, tb, torch.float32, g), _make(0, 5, 8, ta, tb, torch.float32, g)
        ins = [t.to(device).requires_grad_(True) for t in (a0, w0, a1, w1)]
        o0, o1 = mmfuse.dual_gemm(*ins, ta, tb)
        (o0.sum() + 2 * o1.sum()).backward()
        ref = [t.detach().cpu().double().requires_grad_(True) for t in ins]
        r0, r1 = _op(ref[0], ta) @ _op(ref[1], tb), _op(ref[2], ta) @ _op(ref[3], tb)
        (r0.sum() + 2 * r1.sum()).backward()
        for got, want in zip(ins, ref):
            torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=1e-5, atol=1e-5)
    mlp = mmfuse.nn.DualExpertMLP((16, 16), (8, 4), device=device)
    x = torch.randn(7, 16, device=device, requires_grad=True)
    mlp(x, torch.tensor([0, 1, 0, 0, 1, 1, 0], device=device), num_tokens0=4).sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None for p in mlp.parameters())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_outputs_that_overlap_are_an_error(device):
    a, w = torch.randn(6, 4, device=device), torch.randn(4, 4, device=device)
    out = torch.empty(6, 4, device=device)
    with pytest.raises(ValueError, match="out0 overlaps a0"):
        mmfuse.dual_gemm_out(a, w, a.clone(), w, a, out)
    with pytest.raises(ValueError, match="out1 overlaps out0"):
        mmfuse.dual_gemm_out(a, w, a, w, out, out)  # one tensor for both outputs would lose expert 0
    big = torch.empty(12, 4, device=device)
    mmfuse.dual_gemm_out(a, w, a, w, big[:6], big[6:])  # two halves of one buffer are separate
    assert torch.equal(big[:6], big[6:]) and torch.allclose(big[:6], a @ w)


@pytest.mark.parametrize("device", DEVICES)
def test_operands_as_views(device):
    # views a caller has (a transposed or column-strided tensor, a broadcast row): the dense result, and
    # gradients to the views' bases
    g = torch.Generator().manual_seed(12)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    base_a = torch.randn(16, 40, generator=g).to(device, dt)
    base_w = torch.randn(24, 32, generator=g).to(device, dt)
    row = torch.randn(1, 16, generator=g).to(device, dt)
    cases = [(base_a.t(), base_w[:, ::2]),                 # [40, 16] transposed, [24, 16] strided columns
             (row.expand(7, 16), base_w.t()[:16].t()[:5])]  # broadcast rows; a [5, 16] view with row stride 1
    for a, w in cases:
        a_, w_ = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        o0, o1 = mmfuse.dual_gemm(a_, w_, a_[:3], w_, False, True)
        d0, d1 = a.contiguous() @ w.contiguous().t(), a[:3].contiguous() @ w.contiguous().t()
        tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o0, d0, **tol)
        torch.testing.assert_close(o1, d1, **tol)
        (o0.float().sum() + o1.float().sum()).backward()
        assert a_.grad is not None and w_.grad is not None
        ga = torch.ones_like(d0) @ w.contiguous()
        ga[:3] += torch.ones_like(d1) @ w.contiguous()
        torch.testing.assert_close(a_.grad, ga, **tol)


def _fp8_pair(grad_dtype=torch.float8_e5m2, scaling="delayed"):
    # a DualExpertMLP in fp8 and a MoTExperts in fp8 with the same weights (one width: 32)
    from mmfuse.nn import DualExpertMLP
    from mmfuse.nn.vla import MoTExperts

    g = torch.Generator().manual_seed(21)
    d = DualExpertMLP((32, 32), (48, 16), dtype=torch.bfloat16, fp8=True, grad_dtype=grad_dtype, scaling=scaling)
    m = MoTExperts(32, (48, 16), fp8=True, grad_dtype=grad_dtype, scaling=scaling, dtype=torch.bfloat16)
    with torch.no_grad():
        for name in ("gate_up0", "down0", "gate_up1", "down1"):
            w = (torch.randn(getattr(d, name).shape, generator=g) * 0.2).bfloat16()
            getattr(d, name).copy_(w)
            getattr(m, name).copy_(w)
    return d, m


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_dual_expert_mlp_fp8_equals_the_fp8_expert_block(scaling):
    # DualExpertMLP(fp8=True) runs each expert through the same fp8 expert as MoTExperts: the same bits,
    # outputs and gradients, over three steps (the delayed states move alike)
    d, m = _fp8_pair(scaling=scaling)
    g = torch.Generator().manual_seed(22)
    for step in range(3):
        x0, x1 = (torch.randn(n, 32, generator=g).bfloat16() for n in (29, 7))
        dy = torch.randn(36, 32, generator=g).bfloat16()
        a0, a1, b = x0.clone().requires_grad_(), x1.clone().requires_grad_(), torch.cat([x0, x1]).requires_grad_()
        y0, y1 = d.forward_experts(a0, a1)
        y = m(b, 29)
        assert torch.equal(torch.cat([y0, y1]), y), step
        torch.autograd.backward((y0, y1), (dy[:29], dy[29:]))
        y.backward(dy)
        assert torch.equal(torch.cat([a0.grad, a1.grad]), b.grad), step
        for name in ("gate_up0", "down0", "gate_up1", "down1"):
            assert torch.equal(getattr(d, name).grad, getattr(m, name).grad), (step, name)
            getattr(d, name).grad = getattr(m, name).grad = None
    for a, b in zip(d.fp8_delayed_states(), m.fp8_delayed_states()):
        assert torch.equal(a, b)
    assert len(d.fp8_delayed_states()) == (8 if scaling == "delayed" else 0)


def test_dual_expert_mlp_fp8_is_close_to_bf16_and_routes_by_token_type():
    from mmfuse.nn import DualExpertMLP

    d, _ = _fp8_pair()
    ref = DualExpertMLP((32, 32), (48, 16), dtype=torch.bfloat16)
    ref.load_state_dict(d.state_dict())
    g = torch.Generator().manual_seed(23)
    x = torch.randn(40, 32, generator=g).bfloat16()
    tt = (torch.arange(40) >= 31).int()
    with torch.no_grad():
        got, want = d(x, tt, 31), ref(x, tt, 31)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.1  # e4m3 operands
    assert not torch.equal(got, want)  # the fp8 path ran
    # cast as a model is: the states stay float32
    assert all(s.dtype == torch.float32 for s in d.half().fp8_delayed_states())


def test_convert_to_fp8_turns_on_the_experts():
    from mmfuse.nn import DualExpertMLP, Fp8Linear, convert_to_fp8
    from mmfuse.nn.vla import MoTExperts

    model = torch.nn.ModuleDict(dict(proj=torch.nn.Linear(32, 32), dual=DualExpertMLP((32, 32), (48, 16)),
                                     mot=MoTExperts(32, (48, 16)), keep=DualExpertMLP((32, 32), (48, 16))))
    assert not model["dual"].fp8 and not model["dual"].fp8_delayed_states()
    convert_to_fp8(model, lambda name, m: name != "keep", grad_dtype=torch.float8_e4m3fn, history=4)
    assert isinstance(model["proj"], Fp8Linear)
    for e in (model["dual"], model["mot"]):
        assert e.fp8 and e.grad_dtype == torch.float8_e4m3fn and e.scaling == "delayed"
        assert len(e.fp8_delayed_states()) == 8 and e.gate_up0_x_state.shape == _state_shape(4)
    assert not model["keep"].fp8
    with pytest.raises(ValueError, match=r"convert_to_fp8: recipe='row': not an option of the fp8 experts \(dual"):
        convert_to_fp8(torch.nn.ModuleDict(dict(dual=DualExpertMLP((32, 32), (48, 16)))), recipe="row")
    # a Linear-only option at the value that is the experts' behaviour too is taken; another value is not
    convert_to_fp8(torch.nn.ModuleDict(dict(dual=DualExpertMLP((32, 32), (48, 16)))), fuse_wgrad_accumulation=False)
    with pytest.raises(ValueError, match=r"fuse_wgrad_accumulation=True: not an option of the fp8 experts"):
        convert_to_fp8(torch.nn.ModuleDict(dict(dual=DualExpertMLP((32, 32), (48, 16)))), fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match="DualExpertMLP: scaling: expected 'dynamic' or 'delayed', got 'rows'"):
        DualExpertMLP((32, 32), (48, 16), fp8=True, scaling="rows")


def _state_shape(history):
    from mmfuse import fp8 as _fp8

    return _fp8.new_state(history, "cpu").shape


@pytest.mark.parametrize("fp8", [False, True])
def test_dual_expert_mlp_backward_has_no_slice_gradients(fp8, record_ops):
    # the grouped rows are split between the experts, not sliced: no zero-filled [T, H] gradient each
    from mmfuse.nn import DualExpertMLP

    d = DualExpertMLP((32, 32), (48, 16), dtype=torch.bfloat16, fp8=fp8)
    g = torch.Generator().manual_seed(24)
    x = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
    y = d(x, (torch.arange(40) >= 31).int(), 31)
    with record_ops() as rec:
        y.backward(torch.randn(40, 32, generator=g).bfloat16())
    assert not [n for n, _ in rec.ops if n == "slice_backward"] and rec.fills_of(40 * 32) == [], rec.ops
