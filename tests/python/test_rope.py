"""Rotary family: the torch ops against the HF formula written in torch (bitwise per numerics mode),
float64 gradcheck on the CPU, opcheck, torch.compile(fullgraph=True), CUDA graphs, and bad inputs."""

import pytest
import torch

import mmfuse
import mmfuse.backend
from mmfuse.bench.references import (hf_apply, hf_tables, hf_vision, inv_freq_of, make_positions, rotate_half,
                                     section_of, select_sections, vision_freqs)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# ---- forward / backward, bitwise against the references ----------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 72, 80, 128, 256])
@pytest.mark.parametrize("layout", ["plain", "sectioned", "interleaved"])
@pytest.mark.parametrize("numerics", ["fp32", "hf_eager"])
def test_mrope_table_bitwise(device, dtype, D, layout, numerics):
    torch.manual_seed(D)
    B, L, Hq, Hk = 2, 19, 5, 3
    section = None if layout == "plain" else section_of(D, layout == "interleaved")
    interleaved = layout == "interleaved"
    pos = make_positions(B, L, device, seed=D)
    cos, sin = hf_tables(pos, inv_freq_of(D, device), dtype)
    if layout == "plain":
        cos, sin = cos[:1], sin[:1]
    q = torch.randn(B, Hq, L, D, dtype=dtype, device=device)
    k = torch.randn(B, Hk, L, D, dtype=dtype, device=device)
    qo, ko = mmfuse.mrope(q, k, cos[0] if layout == "plain" else cos, sin[0] if layout == "plain" else sin,
                          mrope_section=section, interleaved=interleaved, numerics=numerics)
    assert bits_equal(qo, hf_apply(q, cos, sin, section, interleaved, numerics))
    assert bits_equal(ko, hf_apply(k, cos, sin, section, interleaved, numerics))
    # backward op, bitwise against what autograd computes for HF's formula
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq, dk = torch.ops.mmfuse.mrope_backward(gq, gk, cos, sin, None, None, section or [], interleaved, numerics,
                                             True)
    assert bits_equal(dq, hf_apply(gq, cos, sin, section, interleaved, numerics, backward=True))
    assert bits_equal(dk, hf_apply(gk, cos, sin, section, interleaved, numerics, backward=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numerics", ["fp32", "hf_eager"])
def test_hf_eager_backward_is_autograd_of_hf(device, numerics):
    """The backward op equals torch autograd through HF's eager formula (bf16, per-op rounding)."""
    torch.manual_seed(1)
    B, L, H, D = 2, 23, 4, 128
    pos = make_positions(B, L, device, seed=3)
    cos, sin = hf_tables(pos, inv_freq_of(D, device), torch.bfloat16)
    q = torch.randn(B, H, L, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    k = torch.randn(B, 2, L, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    section = [16, 24, 24]
    qo, ko = mmfuse.mrope(q, k, cos, sin, mrope_section=section, numerics=numerics)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward([qo, ko], [gq, gk])
    qr = q.detach().clone().requires_grad_()
    kr = k.detach().clone().requires_grad_()
    if numerics == "hf_eager":
        c = select_sections(cos, section, False).unsqueeze(1)
        s = select_sections(sin, section, False).unsqueeze(1)
        ref_q, ref_k = qr * c + rotate_half(qr) * s, kr * c + rotate_half(kr) * s
    else:
        ref_q = hf_apply(qr, cos, sin, section, False, "fp32")
        ref_k = hf_apply(kr, cos, sin, section, False, "fp32")
    torch.autograd.backward([ref_q, ref_k], [gq, gk])
    if numerics == "hf_eager":
        assert bits_equal(q.grad, qr.grad) and bits_equal(k.grad, kr.grad)
    else:  # autograd of the fp32-upcast formula rounds twice (grad in fp32, cast to bf16): compare closely
        torch.testing.assert_close(q.grad, qr.grad, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", ["fp32", "hf_eager"])
def test_mrope_positions_equal_tables(device, dtype, numerics):
    """positions + inv_freq (sincosf in the kernel) == the HF table path, bit for bit on the GPU."""
    torch.manual_seed(2)
    B, L, D = 2, 257, 128
    pos = make_positions(B, L, device, seed=5)
    inv = inv_freq_of(D, device)
    q = torch.randn(B, 7, L, D, dtype=dtype, device=device)
    k = torch.randn(B, 1, L, D, dtype=dtype, device=device)
    section = [16, 24, 24]
    qo, ko = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=section, numerics=numerics)
    # fp32 mode uses fp32 cos/sin; hf_eager rounds them to q's dtype first, as HF's .to(x.dtype) does
    cos, sin = hf_tables(pos, inv, torch.float32 if numerics == "fp32" else dtype)
    ref_q = hf_apply(q, cos, sin, section, False, numerics)
    if device == "cuda":
        assert bits_equal(qo, ref_q)
    else:  # the CPU takes cos/sin from the host libm: within a rounding of the GPU's sincosf
        torch.testing.assert_close(qo.float(), ref_q.float(), atol=4e-2 if dtype != torch.float32 else 1e-5, rtol=0)
    assert ko.shape == k.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["blhd", "thd"])
def test_layouts_and_strides(device, layout):
    """Fused qkv views (strided heads/tokens) in the blhd and thd layouts, and in place."""
    torch.manual_seed(3)
    B, L, Hq, Hk, D = 2, 33, 6, 2, 80
    qkv = torch.randn(B, L, Hq + 2 * Hk, D, dtype=torch.bfloat16, device=device)
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
    pos = make_positions(B, L, device)
    inv = inv_freq_of(D, device)
    section = section_of(D, False)
    ref_q, ref_k = mmfuse.mrope(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), positions=pos,
                                inv_freq=inv, mrope_section=section)
    if layout == "thd":
        q, k, p = q[0], k[0], pos[:, 0]
        ref_q, ref_k = ref_q[0], ref_k[0]
    else:
        p = pos
    qo, ko = mmfuse.mrope(q, k, positions=p, inv_freq=inv, mrope_section=section, qk_layout=layout)
    assert bits_equal(qo, ref_q.transpose(-3, -2)) and bits_equal(ko, ref_k.transpose(-3, -2))
    before_v = qkv[..., Hq + Hk:, :].clone()
    mmfuse.mrope_(q, k, positions=p, inv_freq=inv, mrope_section=section, qk_layout=layout)
    assert bits_equal(q, qo) and bits_equal(k, ko)
    assert bits_equal(qkv[..., Hq + Hk:, :], before_v)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_backend_rope(device):
    """Seed signature: doubled sections, outputs written in place or into separate tensors."""
    torch.manual_seed(4)
    B, L, D = 1, 40, 128
    pos = make_positions(B, L, device)
    cos, sin = hf_tables(pos, inv_freq_of(D, device), torch.bfloat16)
    q = torch.randn(B, 4, L, D, dtype=torch.bfloat16, device=device)
    k = torch.randn(B, 2, L, D, dtype=torch.bfloat16, device=device)
    ref_q = hf_apply(q, cos, sin, [16, 24, 24], False, "fp32")
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    mmfuse.backend.rope(q, k, cos, sin, q_out, k_out, [32, 48, 48])
    assert bits_equal(q_out, ref_q)
    q2, k2 = q.clone(), k.clone()
    mmfuse.backend.rope(q2, k2, cos, sin, q2, k2, True)
    assert bits_equal(q2, ref_q) and bits_equal(k2, k_out)
    gq, gk = torch.empty_like(q), torch.empty_like(k)
    mmfuse.backend.rope_bwd(q_out, k_out, q, k, cos, sin, gq, gk, [32, 48, 48])
    torch.testing.assert_close(gq.float(), q.float(), atol=0.07, rtol=0.02)  # R^T R = I up to bf16 rounding
    with pytest.raises(ValueError, match="mrope_section_doubled"):
        mmfuse.backend.rope(q, k, cos, sin, q_out, k_out, [32, 48, 47])


# ---- vision RoPE --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_rope(device, dtype):
    torch.manual_seed(5)
    N, H, D = 333, 16, 80
    freqs = vision_freqs(N, D, device)
    q = torch.randn(N, H, D, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(N, H, D, dtype=dtype, device=device, requires_grad=True)
    qo, ko = mmfuse.vision_rope(q, k, freqs)
    rq, rk = hf_vision(q.detach(), k.detach(), freqs)
    if device == "cuda":
        assert bits_equal(qo, rq) and bits_equal(ko, rk)
    else:
        tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}[dtype]
        torch.testing.assert_close(qo.float(), rq.float(), atol=tol, rtol=tol)
    g = torch.randn_like(qo)
    (qo * g).float().sum().backward()
    assert k.grad is not None and bool((k.grad == 0).all())
    q_ref = q.detach().clone().requires_grad_()
    ref_q, _ = hf_vision(q_ref, k.detach(), freqs)
    (ref_q * g).float().sum().backward()
    torch.testing.assert_close(q.grad.float(), q_ref.grad.float(), atol=4e-2 if dtype == torch.bfloat16 else 5e-3,
                               rtol=1e-2)


# ---- autograd, opcheck, compile, graphs ---------------------------------------------------------

def test_gradcheck_float64_cpu():
    torch.manual_seed(6)
    B, L, D = 1, 5, 16
    pos = make_positions(B, L, "cpu")
    inv = inv_freq_of(D, "cpu")
    q = torch.randn(B, 3, L, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, 2, L, D, dtype=torch.float64, requires_grad=True)
    for kw in [dict(mrope_section=[2, 3, 3]), dict(mrope_section=[4, 2, 2], interleaved=True), dict()]:
        p = pos if kw else pos[0]
        f = lambda q, k: mmfuse.mrope(q, k, positions=p, inv_freq=inv, **kw)  # noqa: E731
        assert torch.autograd.gradcheck(f, (q, k))
        assert torch.autograd.gradgradcheck(f, (q, k))
    freqs = vision_freqs(7, 16, "cpu")
    qv = torch.randn(7, 2, 16, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(7, 2, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: mmfuse.vision_rope(a, b, freqs), (qv, kv))


def test_autograd_saves_only_angles():
    """The graph keeps the angle source, never q or k."""
    pos = make_positions(1, 9, "cpu")
    inv = inv_freq_of(64, "cpu")
    q = torch.randn(1, 2, 9, 64, requires_grad=True)
    k = torch.randn(1, 2, 9, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        qo, _ = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[8, 12, 12])
    ptrs = {t.data_ptr() for t in saved}
    assert q.data_ptr() not in ptrs and k.data_ptr() not in ptrs
    assert pos.data_ptr() in ptrs and inv.data_ptr() in ptrs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.manual_seed(7)
    B, L, D = 2, 11, 64
    pos = make_positions(B, L, device)
    inv = inv_freq_of(D, device)
    cos, sin = hf_tables(pos, inv, torch.float32)
    q = torch.randn(B, 4, L, D, device=device, requires_grad=True)
    k = torch.randn(B, 2, L, D, device=device, requires_grad=True)
    sec = [8, 12, 12]
    ops = torch.ops.mmfuse
    torch.library.opcheck(ops.mrope.default, (q, k, None, None, pos, inv, sec, False, "fp32", True))
    torch.library.opcheck(ops.mrope.default, (q, k, cos, sin, None, None, sec, False, "hf_eager", True))
    torch.library.opcheck(ops.mrope_backward.default, (q, k, None, None, pos, inv, sec, True, "fp32", True))
    qd, kd = q.detach().clone(), k.detach().clone()
    torch.library.opcheck(ops.mrope_.default, (qd, kd, None, None, pos, inv, sec, False, "fp32", False, True))
    torch.library.opcheck(ops.mrope_out.default, (q.detach(), k.detach(), cos, sin, None, None, sec, False, "fp32",
                                                  False, True, torch.empty_like(q), torch.empty_like(k)))
    freqs = vision_freqs(L, D, device)
    qv = torch.randn(L, 3, D, device=device, requires_grad=True)
    kv = torch.randn(L, 3, D, device=device, requires_grad=True)
    torch.library.opcheck(ops.vision_rope.default, (qv, kv, freqs))
    torch.library.opcheck(ops.vision_rope_backward.default, (qv, kv, freqs))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch.manual_seed(8)
    B, L, D = 2, 17, 128
    pos = make_positions(B, L, device)
    inv = inv_freq_of(D, device)
    q = torch.randn(B, 4, L, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    k = torch.randn(B, 2, L, D, dtype=torch.bfloat16, device=device, requires_grad=True)

    def f(q, k, pos):
        qo, ko = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[16, 24, 24])
        return (qo.float() ** 2).sum() + (ko.float() * 3).sum()

    # inductor on the GPU; on the CPU aot_eager traces the same fakes and autograd without a C++ build
    backend = "aot_eager" if device == "cpu" else "inductor"
    cf = torch.compile(f, fullgraph=True, backend=backend)
    ref = f(q, k, pos)
    gq_ref, gk_ref = torch.autograd.grad(ref, (q, k))
    out = cf(q, k, pos)
    gq, gk = torch.autograd.grad(out, (q, k))
    torch.testing.assert_close(out, ref)  # the loss's reduction order may differ
    assert bits_equal(gq, gq_ref) and bits_equal(gk, gk_ref)
    freqs = vision_freqs(L, 80, device)
    qv = torch.randn(L, 2, 80, device=device)
    vf = torch.compile(lambda a, b: mmfuse.vision_rope(a, b, freqs), fullgraph=True, backend=backend)
    assert all(bits_equal(x, y) for x, y in zip(vf(qv, qv), mmfuse.vision_rope(qv, qv, freqs)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_capture():
    torch.manual_seed(9)
    B, L, D = 2, 300, 128
    pos = make_positions(B, L, "cuda")
    inv = inv_freq_of(D, "cuda")
    q = torch.randn(B, 8, L, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, 2, L, D, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[16, 24, 24])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qo, ko = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[16, 24, 24])
    q.copy_(torch.randn_like(q))
    pos.copy_(make_positions(B, L, "cuda", seed=11))
    qo.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[16, 24, 24])
    assert bits_equal(qo, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_runs_on_current_stream():
    """The op is ordered after work queued on the caller's stream (no default-stream launch)."""
    B, L, D = 1, 4096, 128
    pos = make_positions(B, L, "cuda")
    inv = inv_freq_of(D, "cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q = torch.randn(B, 28, L, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B, 4, L, D, dtype=torch.bfloat16, device="cuda")
        torch.cuda._sleep(2_000_000)
        q.mul_(2)
        qo, _ = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[16, 24, 24])
    s.synchronize()
    ref, _ = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=[16, 24, 24])
    assert bits_equal(qo, ref)


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_inputs_name_the_problem():
    pos = make_positions(1, 8, "cpu")
    inv = inv_freq_of(64, "cpu")
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    sec = [8, 12, 12]

    def call(**kw):
        args = dict(q=q, k=k, positions=pos, inv_freq=inv, mrope_section=sec)
        args.update(kw)
        return mmfuse.mrope(args.pop("q"), args.pop("k"), **args)

    with pytest.raises(ValueError, match="inv_freq: expected dtype float32, got bfloat16"):
        call(inv_freq=inv.bfloat16())
    with pytest.raises(ValueError, match="mrope_section: expected entries summing to head_dim / 2 = 32"):
        call(mrope_section=[8, 12, 13])
    with pytest.raises(ValueError, match="even head dim"):
        call(q=torch.randn(1, 2, 8, 63, dtype=torch.bfloat16), k=torch.randn(1, 2, 8, 63, dtype=torch.bfloat16),
             inv_freq=inv[:31])
    with pytest.raises(ValueError, match="k: expected dtype bfloat16"):
        call(k=k.half())
    with pytest.raises((ValueError, TypeError), match="q: expected dtype|unsupported dtype"):
        call(q=q.to(torch.int32), k=k.to(torch.int32))
    with pytest.raises(ValueError, match="positions: expected dtype int32 or int64"):
        call(positions=pos.float())
    with pytest.raises(ValueError, match="positions: expected 8 tokens"):
        call(positions=pos[..., :7])
    with pytest.raises(ValueError, match="exactly one angle source"):
        mmfuse.mrope(q, k, mrope_section=sec)
    with pytest.raises(ValueError, match="numerics"):
        call(numerics="bf16")
    with pytest.raises(ValueError, match="qk_layout"):
        call(qk_layout="lbhd")
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        call(q=q.transpose(-1, -2).contiguous().transpose(-1, -2)[..., :64])
    with pytest.raises(ValueError, match="gradients with respect to the angles"):
        cos, sin = hf_tables(pos, inv, torch.bfloat16)
        mmfuse.mrope(q, k, cos.requires_grad_(), sin, mrope_section=sec)
    with pytest.raises(ValueError, match="freqs: expected dtype float32"):
        mmfuse.vision_rope(q[0].transpose(0, 1), k[0].transpose(0, 1), torch.zeros(8, 32, dtype=torch.float64))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="expected device cuda:0, got cpu"):
            call(q=q.cuda(), k=k.cuda())


@pytest.mark.parametrize("device", DEVICES)
def test_direct_entry_point_is_the_same_op(device):
    """The eager entry point of _C (when built with the Python headers) gives the op's result, keeps
    autograd, and steps aside for torch-function modes, which must see the torch.ops call."""
    from mmfuse import _lib, rope

    q = torch.randn(2, 3, 5, 64, device=device, requires_grad=True)
    k = torch.randn(2, 1, 5, 64, device=device)
    pos = make_positions(2, 5, device, seed=3)
    inv = inv_freq_of(64, device)
    sec = [8, 12, 12]
    if _lib.fast is not None:
        assert rope._direct(q, k, None, None, pos, inv)
    ours = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=sec)
    ref = torch.ops.mmfuse.mrope.default(q, k, None, None, pos, inv, sec, False, "fp32", True)
    assert all(bits_equal(a, b) for a, b in zip(ours, ref))
    ours[0].sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape

    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        assert not rope._direct(q, k, None, None, pos, inv)
        mmfuse.mrope(q.detach(), k, positions=pos, inv_freq=inv, mrope_section=sec)
    assert torch.ops.mmfuse.mrope.default in seen


# Aliasing and overlap (the in-place rule): errors naming the problem, nothing written first.
def test_inplace_aliasing_is_an_error():
    B, H, L, D = 1, 2, 6, 16
    pos = make_positions(B, L, "cpu")
    inv = inv_freq_of(D, "cpu")
    kw = dict(positions=pos, inv_freq=inv, mrope_section=[2, 3, 3])
    x = torch.randn(B, H, L, D)
    before = x.clone()
    with pytest.raises(ValueError, match="q and k share memory: rotated in place, the shared elements would rotate"):
        mmfuse.mrope_(x, x, **kw)
    assert torch.equal(x, before)  # nothing written
    buf = torch.randn(B, 3, L, D)
    with pytest.raises(ValueError, match="q and k share memory"):
        mmfuse.mrope_(buf[:, :2], buf[:, 1:3], **kw)  # overlapping head ranges
    with pytest.raises(ValueError, match=r"q_out is expanded \(a stride of 0 along a dim of more than one element\)"):
        mmfuse.mrope_(torch.randn(B, 1, L, D).expand(B, H, L, D), torch.randn(B, H, L, D), **kw)
    with pytest.raises(RuntimeError, match="q or k requires grad, and the in-place rotation is not differentiable"):
        mmfuse.mrope_(torch.randn(B, H, L, D, requires_grad=True), torch.randn(B, H, L, D), **kw)
    # q and k as head slices of one fused buffer are separate: in place is fine
    qkv = torch.randn(B, L, 5, D)
    want = mmfuse.mrope(qkv[:, :, :3], qkv[:, :, 3:], qk_layout="blhd", **kw)
    mmfuse.mrope_(qkv[:, :, :3], qkv[:, :, 3:], qk_layout="blhd", **kw)
    assert torch.equal(qkv[:, :, :3], want[0]) and torch.equal(qkv[:, :, 3:], want[1])
    # the seed's rope with its outputs swapped
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    cos, sin = hf_tables(pos, inv, torch.float32)
    with pytest.raises(ValueError, match="q_out overlaps k"):
        mmfuse.backend.rope(q, k, cos, sin, k, q, [4, 6, 6])


def test_inplace_moves_the_version_counter():
    B, H, L, D = 1, 2, 6, 16
    kw = dict(positions=make_positions(B, L, "cpu"), inv_freq=inv_freq_of(D, "cpu"), mrope_section=[2, 3, 3])
    a = torch.randn(B, H, L, D, requires_grad=True)
    y = a * 2
    z = y * y  # saves y
    with torch.no_grad():
        mmfuse.mrope_(y, torch.randn(B, H, L, D), **kw)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_rank_of_q_must_match_the_layout():
    q = torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match=r"mrope: q: expected a 4-D tensor \[B, H, L, D\] \(qk_layout='bhld'\), got 3-D"):
        mmfuse.mrope(q, q, positions=torch.zeros(3, 6, dtype=torch.long), inv_freq=inv_freq_of(16, "cpu"),
                     mrope_section=[2, 3, 3])
    with pytest.raises(ValueError, match=r"mrope_: k: expected a 3-D tensor \[T, H, D\] \(qk_layout='thd'\), got 4-D"):
        mmfuse.mrope_(q, torch.randn(1, 6, 2, 16), positions=torch.zeros(3, 6, dtype=torch.long),
                      inv_freq=inv_freq_of(16, "cpu"), mrope_section=[2, 3, 3], qk_layout="thd")
