"""Fused linear cross-entropy against F.linear + F.cross_entropy in float64 (loss and gradients), for
every reduction, ignore_index, label smoothing, z-loss, softcap and bias, chunks that do not divide
the tokens; opcheck, torch.compile, CUDA against the CPU; bad input."""

import pytest
import torch
import torch.nn.functional as F

import mmfuse

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference(h, w, y, b, ignore_index, reduction, ls, z_loss, softcap):
    z = F.linear(h, w, b)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="none", label_smoothing=ls)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(z, -1).square() * (y != ignore_index)
    if reduction == "none":
        return loss
    return loss.sum() / ((y != ignore_index).sum().clamp_min(1) if reduction == "mean" else 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16 logits", "bf16 weight gradient"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [dict(), dict(ls=0.1), dict(z_loss=1e-3, softcap=30.0), dict(bias=True, ls=0.05)])
def test_matches_float64(device, dtype, reduction, opts, monkeypatch):
    import importlib

    # groups of two 8-token chunks: three weight-gradient groups over the 37 tokens
    monkeypatch.setattr(importlib.import_module("mmfuse.linear_cross_entropy"), "DW_GROUP_TOKENS", 16)
    logits_dtype = weight_grad_dtype = torch.float32
    if dtype == "bf16 logits":  # the logits in hidden's dtype, as F.linear makes them
        dtype = logits_dtype = torch.bfloat16
    if dtype == "bf16 weight gradient":  # accumulated in bf16 over the chunk groups
        dtype = weight_grad_dtype = torch.bfloat16
    g = torch.Generator().manual_seed(len(reduction) + len(opts))
    T, H, V = 37, 24, 101
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype)
    b = (0.1 * torch.randn(V, generator=g)).to(dtype) if opts.get("bias") else None
    y = torch.randint(0, V, (T,), generator=g)
    y[::5] = -100
    ls, zl, sc = opts.get("ls", 0.0), opts.get("z_loss", 0.0), opts.get("softcap", 0.0)
    leaves = (h, w) + ((b,) if b is not None else ())
    ins = [t.detach().to(device).requires_grad_() for t in leaves]
    loss = mmfuse.linear_cross_entropy(ins[0], ins[1], y.to(device), ins[2] if b is not None else None,
                                       reduction=reduction, label_smoothing=ls, z_loss=zl,
                                       logit_softcap=sc or None, chunk_tokens=8, logits_dtype=logits_dtype,
                                       weight_grad_dtype=weight_grad_dtype)
    gl = torch.randn(loss.shape, generator=g).to(device) if reduction == "none" else torch.tensor(1.7, device=device)
    (loss * gl).sum().backward()
    ref_ins = [t.detach().double().requires_grad_() for t in leaves]
    ref = _reference(ref_ins[0], ref_ins[1], y, ref_ins[2] if b is not None else None, -100, reduction, ls, zl, sc)
    (ref * gl.cpu().double()).sum().backward()
    # bf16 operands: the logits are exact fp32 products of the rounded inputs; the gradients' GEMMs take
    # the logits' gradient rounded to bf16 (2^-8 relative)
    # bf16 logits: each rounded to 2^-9 relative before the softmax (the unfused bf16 step's own error)
    # bf16 weight gradient: one more rounding (2^-9) a group of two 8-token chunks, three groups here
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=tol, atol=tol)
    for got, want in zip(ins, ref_ins):
        err = float((got.grad.double().cpu() - want.grad).norm() / want.grad.norm())
        assert err <= (1e-5 if dtype == torch.float32 else 1.5e-2 if logits_dtype == torch.float32 else 2.5e-2), err


def test_all_tokens_ignored_and_no_grad_mode():
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    y = torch.full((4,), -100)
    assert float(mmfuse.linear_cross_entropy(h, w, y)) == 0.0
    with torch.no_grad():
        out = torch.ops.mmfuse.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), None, -100, "mean", 0.0,
                                                    0.0, 0.0, 2, False)
    assert out[1].numel() == 0 and out[2].numel() == 0  # no gradients computed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_backward_gives_the_same_gradients(dtype):
    # the backward scales the saved weight gradient into a new tensor, never in place (an fp32 weight's
    # .to() would be the saved tensor itself), so a retained graph gives the same gradients again
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, 50, (37,), generator=g)
    loss = 3.0 * mmfuse.linear_cross_entropy(h, w, y, chunk_tokens=8)
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("groups", [1, 4])
def test_weight_gradient_groups_agree(groups, monkeypatch):
    # the weight gradient's GEMM over `groups` chunks at once (the bench's row): the same sums, grouped
    import importlib

    lce = importlib.import_module("mmfuse.linear_cross_entropy")
    g = torch.Generator().manual_seed(8)
    h = torch.randn(45, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(30, 16, generator=g).bfloat16().requires_grad_()
    y = torch.randint(0, 30, (45,), generator=g)
    want = torch.autograd.grad(mmfuse.linear_cross_entropy(h, w, y, chunk_tokens=4), (h, w))
    monkeypatch.setattr(lce, "DW_GROUP_TOKENS", 4 * groups)
    got = torch.autograd.grad(mmfuse.linear_cross_entropy(h, w, y, chunk_tokens=4), (h, w))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_hidden_gradient_per_chunk_or_per_group_agree(bias, monkeypatch):
    # d_hidden's GEMM a chunk at a time (default) or over a group's logit gradients (the bench's row)
    import importlib

    lce = importlib.import_module("mmfuse.linear_cross_entropy")
    g = torch.Generator().manual_seed(9)
    h = torch.randn(45, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(30, 16, generator=g).bfloat16().requires_grad_()
    b = torch.randn(30, generator=g).bfloat16().requires_grad_() if bias else None
    y = torch.randint(0, 30, (45,), generator=g)
    monkeypatch.setattr(lce, "DW_GROUP_TOKENS", 16)  # groups of four 4-token chunks, the last short
    inputs = (h, w) + ((b,) if bias else ())
    want = torch.autograd.grad(mmfuse.linear_cross_entropy(h, w, y, bias=b, chunk_tokens=4), inputs)
    monkeypatch.setattr(lce, "DH_PER_GROUP", not lce.DH_PER_GROUP)
    got = torch.autograd.grad(mmfuse.linear_cross_entropy(h, w, y, bias=b, chunk_tokens=4), inputs)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-2, atol=1e-4)


def test_opcheck_and_compile():
    h = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(19, 16, requires_grad=True)
    y = torch.randint(0, 19, (10,))
    for red in ("mean", "none"):
        torch.library.opcheck(torch.ops.mmfuse.linear_cross_entropy.default,
                              (h, w, y, None, -100, red, 0.0, 0.0, 0.0, 4, red == "mean"))
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    torch.library.opcheck(torch.ops.mmfuse.linear_cross_entropy.default,
                          (hb, wb, y, None, -100, "mean", 0.0, 0.0, 0.0, 4, True, True, False))
    z = torch.randn(6, 19)
    rs = torch.rand(6)
    for want_grad in (True, False):
        torch.library.opcheck(torch.ops.mmfuse.linear_cross_entropy_logits_grad.default,
                              (z, y[:6], rs, -100, 0.1, 1e-3, 20.0, torch.bfloat16, want_grad))
    torch.library.opcheck(torch.ops.mmfuse.linear_cross_entropy_logits_grad_out.default,
                          (z, y[:6], rs, -100, 0.05, 0.0, 0.0, torch.empty(6, 19)))
    big = torch.full((10, 19), float("nan"))  # into rows of a larger buffer, the others untouched
    torch.ops.mmfuse.linear_cross_entropy_logits_grad_out(z, y[:6], rs, -100, 0.0, 0.0, 0.0, big[2:8])
    want = torch.ops.mmfuse.linear_cross_entropy_logits_grad(z, y[:6], rs, -100, 0.0, 0.0, 0.0, torch.float32, True)[1]
    assert torch.equal(big[2:8], want) and big[:2].isnan().all() and big[8:].isnan().all()
    fn = torch.compile(lambda a, b: mmfuse.linear_cross_entropy(a, b, y, chunk_tokens=3), fullgraph=True)
    assert torch.allclose(fn(h, w), mmfuse.linear_cross_entropy(h, w, y, chunk_tokens=3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("path", ["auto", "two", "cluster"])  # the logits gradient's kernels
@pytest.mark.parametrize("V", [1000, 60000])
def test_cuda_matches_cpu(path, V):
    from mmfuse.bench.common import path_override

    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(300, 64, generator=g).bfloat16(), torch.randn(V, 64, generator=g).bfloat16()
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.randint(0, V, (300,), generator=g)
    y[::7] = -100
    want = mmfuse.linear_cross_entropy(hc, wc, y, chunk_tokens=64)
    want.backward()
    hg, wg = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    with path_override("MMFUSE_LCE_GRAD", path):
        got = mmfuse.linear_cross_entropy(hg, wg, y.cuda(), chunk_tokens=64)
        got.backward()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hg.grad.cpu(), hc.grad, rtol=2e-2, atol=1e-5)
    torch.testing.assert_close(wg.grad.cpu(), wc.grad, rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("labels", [torch.full((5,), -100), torch.zeros(0, dtype=torch.long)])
def test_mean_over_no_token_is_zero_with_zero_gradients(labels):
    # the stated rule where PyTorch's mean is 0 / 0 (NaN): every token ignored, or no token
    h = torch.randn(labels.shape[0], 8).requires_grad_()
    w = torch.randn(11, 8).requires_grad_()
    loss = mmfuse.linear_cross_entropy(h, w, labels)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_bad_input():
    # every label bad, rows spread over the CPU's threads: the first one is named (no crash)
    big_h, big_w = torch.randn(64, 8), torch.randn(11, 8)
    with pytest.raises(ValueError, match=r"labels\[0\] = 11: expected a class in \[0, 11\)"):
        mmfuse.linear_cross_entropy(big_h, big_w, torch.full((64,), 11))
    # a bad label in a later chunk: named by its index in the call, not in its chunk, with one prefix
    ok = torch.zeros(64, dtype=torch.long)
    ok[37] = -5
    with pytest.raises(ValueError, match=r"^mmfuse.linear_cross_entropy: labels\[37\] = -5: expected a class"):
        mmfuse.linear_cross_entropy(big_h, big_w, ok, chunk_tokens=8)
    # the kernel op itself names its own row
    with pytest.raises(ValueError, match=r"^mmfuse.linear_cross_entropy_logits_grad: labels\[5\] = -5: expected"):
        torch.ops.mmfuse.linear_cross_entropy_logits_grad(torch.randn(8, 11), ok[32:40], torch.ones(8), -100, 0.0,
                                                          0.0, 0.0, torch.float32, False)
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    with pytest.raises(ValueError, match=r"labels: expected hidden's leading shape \(4,\) \(or its tokens "
                                         r"flattened\), got \(3,\)"):
        mmfuse.linear_cross_entropy(h, w, torch.zeros(3, dtype=torch.long))
    # the same number of labels in another shape: refused (a [B, L] against a [L, B, H] would pass by count)
    with pytest.raises(ValueError, match=r"labels: expected hidden's leading shape \(4,\).*got \(2, 2\)"):
        mmfuse.linear_cross_entropy(h, w, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels: expected hidden's leading shape \(2, 2\).*got \(4, 1\)"):
        mmfuse.linear_cross_entropy(h.view(2, 2, 8), w, torch.zeros(4, 1, dtype=torch.long))
    flat = mmfuse.linear_cross_entropy(h.view(2, 2, 8), w, torch.arange(4))  # [B, L, H] with [B * L] labels
    assert torch.equal(flat, mmfuse.linear_cross_entropy(h, w, torch.arange(4)))
    with pytest.raises(ValueError, match="labels: expected int64 \\[4\\], got torch.float32"):
        mmfuse.linear_cross_entropy(h, w, torch.zeros(4))
    for cap in (0.0, -3.0):
        with pytest.raises(ValueError, match=f"logit_softcap: expected a positive cap or None, got {cap}"):
            mmfuse.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), logit_softcap=cap)
    with pytest.raises(ValueError, match="weight: expected dtype torch.float32"):
        mmfuse.linear_cross_entropy(h, w.double(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits_dtype: expected torch.float32 or hidden's dtype torch.float32"):
        mmfuse.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), logits_dtype=torch.float16)
    with pytest.raises(ValueError, match="weight_grad_dtype: expected torch.float32 or hidden's dtype torch.float32"):
        mmfuse.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), weight_grad_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        mmfuse.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match=r"labels\[2\] = 11: expected a class in \[0, 11\) or ignore_index -100"):
        mmfuse.linear_cross_entropy(h.bfloat16(), w.bfloat16(), torch.tensor([0, 3, 11, -100]))


def test_backward_makes_no_zero_filled_gradients(record_ops):
    # the op's gradient outputs are used by no loss: no zero "gradient" the size of d_hidden or d_weight
    g = torch.Generator().manual_seed(6)
    h = torch.randn(40, 16, generator=g).requires_grad_()
    w = torch.randn(30, 16, generator=g).requires_grad_()
    loss = mmfuse.linear_cross_entropy(h, w, torch.randint(0, 30, (40,), generator=g))
    with record_ops() as rec:
        loss.backward()
    assert rec.fills_of(40 * 16) == [], rec.ops
    assert h.grad is not None and w.grad is not None


@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_accumulator_is_not_zero_filled(T, dtype, monkeypatch):
    # the first group's GEMM writes the accumulator, the others add to it: no [V, H] fill; no tokens:
    # a zero gradient
    import importlib

    monkeypatch.setattr(importlib.import_module("mmfuse.linear_cross_entropy"), "DW_GROUP_TOKENS", 4)  # T 9: 3 groups
    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(30, 16, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, 30, (T,), generator=g)
    # inside the op: seen by the profiler (a dispatch mode sees the op, not what its implementation runs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = mmfuse.linear_cross_entropy(h, w, y, reduction="sum", chunk_tokens=4)
    loss.backward()
    if T == 0:
        assert torch.count_nonzero(w.grad) == 0
        return
    fills = [(e.name, e.input_shapes) for e in prof.events()
             if e.name in ("aten::zero_", "aten::fill_") and [30, 16] in [list(s) for s in e.input_shapes]]
    assert fills == [], fills
    z = torch.nn.functional.linear(h.detach().double(), w.detach().double())
    gz = torch.softmax(z, 1) - torch.nn.functional.one_hot(y, 30).double()
    torch.testing.assert_close(w.grad.double(), gz.t() @ h.detach().double(),
                               **(dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)))
