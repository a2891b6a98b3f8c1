"""SwiGLU on the fused gate/up layout against the compiled-PyTorch formula (fp32 math, one rounding) and a
float64 reference; gradcheck; the recomputed activation equal to the forward's; opcheck, torch.compile,
CUDA graphs, CUDA against the CPU; bad input."""

import pytest
import torch
import torch.nn.functional as F

import mmfuse

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _ref(gate_up):
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 2 * 13), (3, 5, 2 * 2752), (64, 2 * 11008)])
def test_matches_formula_and_grad(device, dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    gu = (3 * torch.randn(shape, generator=g)).to(device, dtype).requires_grad_()
    y = mmfuse.swiglu(gu)
    want = _ref(gu.detach())
    # one rounding of the dtype; for fp32 the few fp32 operations of both sides (about 6 roundings each)
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -20}[dtype]
    sub = 2.0 ** -24 if dtype == torch.float16 else 1e-30  # a rounding's absolute error among subnormals
    assert ((y.float() - want.float()).abs() <= ulp * want.float().abs() + sub).all()
    dy = torch.randn(y.shape, generator=g).to(device, dtype)
    (got,) = torch.autograd.grad(y, gu, dy)
    gd = gu.detach().double().requires_grad_()
    (want_g,) = torch.autograd.grad(_ref(gd), gd, dy.double())
    g_, u_ = gu.detach().double().chunk(2, dim=-1)
    scale = torch.cat([(dy.double() * u_).abs(), (dy.double() * g_).abs()], dim=-1)  # bounds of |dgate|, |dup|
    assert ((got.double() - want_g).abs() <= ulp * want_g.abs() + 2 ** -20 * scale + sub).all()


def test_gradcheck_float64_cpu():
    gu = torch.randn(9, 14, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mmfuse.swiglu, (gu,))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_recomputes_the_forward_bits_and_reads_strided_rows(device):
    g = torch.Generator().manual_seed(2)
    big = torch.randn(33, 2 * 100 + 6, generator=g).to(device, torch.bfloat16)
    gu = big[:, :200]  # padded rows
    y = mmfuse.swiglu(gu)
    from mmfuse.swiglu import swiglu_backward
    dgu, y2 = swiglu_backward(torch.ones_like(y), gu, True)
    assert torch.equal(y, y2)
    assert dgu.shape == gu.shape
    assert torch.equal(mmfuse.swiglu(gu.contiguous()), y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_backward_equals_out_of_place(device, dtype):
    from mmfuse.swiglu import swiglu_backward, swiglu_backward_
    g = torch.Generator().manual_seed(5)
    big = (3 * torch.randn(37, 2 * 300 + 8, generator=g)).to(device, dtype)
    dbig = torch.randn(37, 300 + 4, generator=g).to(device, dtype)
    gu, dy = big[:, :600], dbig[:, :300]  # rows with a stride, as slices of a model's buffers
    want_dgu, want_y = swiglu_backward(dy, gu, True)
    pads, dpads = big[:, 600:].clone(), dbig[:, 300:].clone()
    versions = gu._version, dy._version
    swiglu_backward_(dy, gu)
    assert torch.equal(gu, want_dgu) and torch.equal(dy, want_y)
    assert torch.equal(big[:, 600:], pads) and torch.equal(dbig[:, 300:], dpads)  # only the views written
    assert gu._version > versions[0] and dy._version > versions[1]
    gu2, dy2 = gu.clone(), dy.clone()  # without the activation: dy is left as it was
    want_dgu2, _ = swiglu_backward(dy2, gu2, False)
    swiglu_backward_(dy2, gu2, False)
    assert torch.equal(gu2, want_dgu2) and torch.equal(dy2, dy)


def test_in_place_backward_refuses_what_it_cannot_write():
    from mmfuse.swiglu import swiglu_backward_
    gu = torch.randn(4, 12)
    with pytest.raises(ValueError, match=r"swiglu_backward: gate_up: the last dim must be contiguous"):
        swiglu_backward_(torch.randn(4, 6), torch.randn(12, 4).t())
    with pytest.raises(ValueError, match=r"swiglu_backward: dy: expected shape \[4, 6\]"):
        swiglu_backward_(torch.randn(4, 5), gu)
    # a saved tensor changed in place: autograd refuses the stale copy
    x = torch.randn(4, 12, requires_grad=True)
    y = (x * 2).sigmoid()
    with torch.no_grad():
        swiglu_backward_(torch.randn(4, 6), y[:, :].detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_opcheck_and_compile():
    gu = torch.randn(10, 24, requires_grad=True)
    torch.library.opcheck(torch.ops.mmfuse.swiglu.default, (gu,))
    torch.library.opcheck(torch.ops.mmfuse.swiglu_backward.default, (torch.randn(10, 12), gu.detach(), True))
    for recompute in (True, False):
        torch.library.opcheck(torch.ops.mmfuse.swiglu_backward_.default,
                              (torch.randn(10, 12), torch.randn(10, 24), recompute))
    fn = torch.compile(mmfuse.swiglu, fullgraph=True)
    assert torch.equal(fn(gu), mmfuse.swiglu(gu))


@needs_gpu
def test_cuda_matches_cpu_and_graph_capture():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(1000, 2 * 2752, generator=g).bfloat16()
    want = mmfuse.swiglu(gu)
    gd = gu.cuda()
    got = mmfuse.swiglu(gd)
    # one bf16 ulp (2^-7 relative): two single roundings of nearly equal fp32 values may differ by one
    assert ((got.cpu().float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-6).all()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mmfuse.swiglu(gd)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mmfuse.swiglu(gd)
            dgu, y2 = torch.ops.mmfuse.swiglu_backward(y, gd, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, got) and torch.equal(y2, got)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    with pytest.raises(ValueError, match="expected an even number of columns"):
        mmfuse.swiglu(torch.randn(3, 5, device=device))
    with pytest.raises(ValueError, match=r"dy: expected shape \[3, 4\], got \[3, 5\]"):
        torch.ops.mmfuse.swiglu_backward(torch.randn(3, 5, device=device), torch.randn(3, 8, device=device), True)
    with pytest.raises(ValueError, match=r"gate_up: expected \[..., 2I\], got a 0-d tensor"):
        mmfuse.swiglu(torch.tensor(1.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_and_empty_inputs(device):
    # a broadcast gate_up (stride-0 rows) is read, not refused; the gradient flows back through the expand
    row = torch.randn(1, 16, generator=torch.Generator().manual_seed(6)).to(device).requires_grad_()
    y = mmfuse.swiglu(row.expand(4, 16))
    y.square().sum().backward()
    row2 = row.detach().clone().requires_grad_()
    e = row2.expand(4, 16)
    y2 = F.silu(e[:, :8]) * e[:, 8:]
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row.grad, row2.grad, rtol=1e-5, atol=1e-6)
    assert mmfuse.swiglu(torch.ones(3, 0, device=device)).shape == (3, 0)
    assert mmfuse.swiglu(torch.ones(2, 0, 6, device=device)).shape == (2, 0, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_inputs_give_the_formulas_results(device):
    """The rule: silu(gate) * up with IEEE arithmetic, as F.silu(gate) * up gives it (silu(-inf) = NaN,
    silu(inf) * up = inf * up)."""
    gu = torch.tensor([[float("-inf"), float("inf"), 1.0, float("nan"), 2.0, 3.0, float("nan"), 4.0]], device=device)
    torch.testing.assert_close(mmfuse.swiglu(gu), _ref(gu), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_fp8_and_its_backward(device, dtype):
    # the packed input within half an e4m3 step of each value (per 128-column tile scale), the same bytes
    # on the GPU as on the CPU, strided rows read; the backward from it equal to swiglu_backward on the
    # unpacked values
    from mmfuse.swiglu import swiglu_backward, swiglu_backward_fp8, swiglu_pack_fp8

    g = torch.Generator().manual_seed(11)
    T, I = 37, 200  # 400 columns: 3 full tiles and a partial one
    big = torch.randn(T, 2 * I + 24, generator=g) * torch.exp2(torch.randint(-20, 20, (T, 1), generator=g).float())
    x = big.to(device, dtype)[:, :2 * I]  # strided rows
    q, s = swiglu_pack_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, 2 * I) and s.shape == (T, 4)
    scale = s.repeat_interleave(128, dim=1)[:, :2 * I]
    unpacked = q.double() * scale.double()
    xd = x.double()
    assert bool(((unpacked - xd).abs() <= torch.maximum(xd.abs() / 16, scale.double() / 1024)).all())
    assert bool((torch.log2(s) == torch.log2(s).round()).all())  # powers of two
    if device == "cuda":
        qc, sc = swiglu_pack_fp8(x.cpu())
        assert torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s.cpu(), sc)
    dy = torch.randn(T, I, generator=g).to(device, dtype)
    got_dg, got_y = swiglu_backward_fp8(dy, q, s)
    want_dg, want_y = swiglu_backward(dy, unpacked.to(dtype), True)
    assert torch.equal(got_dg, want_dg) and torch.equal(got_y, want_y)
    assert swiglu_backward_fp8(dy, q, s, recompute=False)[1].shape == (0, I)


def test_pack_fp8_opcheck_compile_and_bad_input():
    from mmfuse.swiglu import swiglu_backward_fp8, swiglu_pack_fp8

    x = torch.randn(9, 260, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.mmfuse.swiglu_pack_fp8.default, (x,))
    q, s = swiglu_pack_fp8(x)
    dy = torch.randn(9, 130, dtype=torch.bfloat16)
    # test_schema perturbs the inputs with a multiply that torch does not implement for float8 tensors
    no_schema = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
    torch.library.opcheck(torch.ops.mmfuse.swiglu_backward_fp8.default, (dy, q, s, True), test_utils=no_schema)

    def f(x, dy):
        q, s = swiglu_pack_fp8(x)
        return swiglu_backward_fp8(dy, q, s)[0]

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, dy), f(x, dy), rtol=0, atol=0)
    with pytest.raises(ValueError, match="swiglu_pack_fp8: gate_up: expected an even number of columns"):
        swiglu_pack_fp8(x[:, :259])
    with pytest.raises(ValueError, match=r"swiglu_backward_fp8: scale_inv: expected shape \[9, 3\], got \[9, 2\]"):
        swiglu_backward_fp8(dy, q, s[:, :2])
    with pytest.raises(ValueError, match="swiglu_backward_fp8: dy: expected bfloat16, float16 or float32, got float64"):
        swiglu_backward_fp8(dy.double(), q, s)
