"""mmfuse.integrations.window_attention: windows of one length batched into one SDPA call, against a
float64 loop of one attention a window (values and gradients), the runs, and the host read of the lengths."""

import pytest
import torch

from mmfuse.integrations.window_attention import sdpa_by_windows, window_lengths, window_runs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_window_runs():
    assert window_runs([]) == []
    assert window_runs([64, 64, 64, 32, 64, 0, 64, 7]) == [(64, 3), (32, 1), (64, 2), (7, 1)]
    assert window_runs([0, 0]) == []
    with pytest.raises(ValueError, match="non-decreasing offsets, got a window of length -3"):
        window_runs([4, -3])


def _loop(q, k, v, lengths, scale):
    """Reference: one softmax attention a window, float64."""
    out, s = [], 0
    for n in lengths:
        a = (q[s:s + n].transpose(0, 1).double() @ k[s:s + n].transpose(0, 1).double().transpose(1, 2)) * scale
        out.append((a.softmax(-1) @ v[s:s + n].transpose(0, 1).double()).transpose(0, 1))
        s += n
    return torch.cat(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[16] * 5, [16, 16, 16, 8, 16, 16, 8, 0, 5], [37], [3, 1, 1, 2]])
def test_sdpa_by_windows_equals_a_window_at_a_time(device, dtype, lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    S, H, D = sum(lengths), 3, 40
    # q, k, v as the tower has them: unbound from one [S, 3, H, D] projection (strided)
    qkv = torch.randn(S, 3, H, D, generator=g).to(device, dtype).requires_grad_(True)
    q, k, v = qkv.permute(1, 0, 2, 3).unbind(0)
    scale = D ** -0.5
    out = sdpa_by_windows(q, k, v, lengths, scale)
    assert out.shape == (S, H, D) and out.dtype == dtype
    ref = _loop(q.detach(), k.detach(), v.detach(), lengths, scale)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    dout = torch.randn(S, H, D, generator=g).to(device, dtype)
    out.backward(dout)
    qkv64 = qkv.detach().double().requires_grad_(True)
    q6, k6, v6 = qkv64.permute(1, 0, 2, 3).unbind(0)
    _loop(q6, k6, v6, lengths, scale).backward(dout.double())
    torch.testing.assert_close(qkv.grad.double(), qkv64.grad, **tol)
    # the per-window SDPA calls transformers makes: the same kernel, so the same values
    per = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[s:s + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=scale)[0].transpose(0, 1)
        for s, n in zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths) if n])
    torch.testing.assert_close(out, per, **(dict(rtol=0, atol=0) if device == "cuda" else tol))


def test_sdpa_by_windows_checks_the_cover():
    q = torch.zeros(10, 2, 8)
    with pytest.raises(ValueError, match="windows covering the 10 patches, got 9"):
        sdpa_by_windows(q, q, q, [4, 5], 1.0)
    assert sdpa_by_windows(q[:0], q[:0], q[:0], [], 1.0).shape == (0, 2, 8)


def test_window_lengths_reads_a_tensor_once():
    cu = torch.tensor([0, 4, 8, 10], dtype=torch.int32)
    first = window_lengths(cu)
    assert first == [4, 4, 2] and window_lengths(cu) is first  # the tower's next layer: no second read
    cu[3] = 12  # changed in place: read again
    assert window_lengths(cu) == [4, 4, 4]
    assert window_lengths(torch.tensor([0, 3], dtype=torch.int32)) == [3]


def test_backward_has_no_slice_gradients(record_ops):
    # one split of q, k and v, not a slice a run: no zero-filled [S, H, D] gradient a run
    from mmfuse.integrations.window_attention import sdpa_by_windows

    g = torch.Generator().manual_seed(8)
    lengths = [16, 16, 8, 16, 4, 4]  # four runs
    S, H, D = sum(lengths), 2, 8
    q, k, v = (torch.randn(S, H, D, generator=g).requires_grad_() for _ in range(3))
    out = sdpa_by_windows(q, k, v, lengths, D ** -0.5)
    with record_ops() as rec:
        out.backward(torch.randn(S, H, D, generator=g))
    assert rec.fills_of(S) == [] and not [n for n, _ in rec.ops if n == "slice_backward"], rec.ops
    # the gradients equal attention window by window
    dout = torch.randn(S, H, D, generator=g)
    q.grad = k.grad = v.grad = None
    sdpa_by_windows(q, k, v, lengths, D ** -0.5).backward(dout)
    start, got = 0, [t.grad for t in (q, k, v)]
    for n in lengths:
        qs, ks, vs = (t.detach()[start:start + n].transpose(0, 1).requires_grad_() for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=D ** -0.5)
        for a, b in zip(torch.autograd.grad(o, (qs, ks, vs), dout[start:start + n].transpose(0, 1)), got):
            torch.testing.assert_close(b[start:start + n], a.transpose(0, 1))
        start += n
