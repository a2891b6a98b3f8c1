"""Fused linear cross-entropy: ``cross_entropy(hidden @ weight^T + bias, labels)`` and its gradients
without ever holding the ``[T, V]`` logits.

The tokens go in chunks: each chunk's logits (fp32 accumulation, rounded to hidden's dtype as
``F.linear`` rounds them, or kept in fp32) are reduced to its loss and log-sum-exp and turned into
their gradient by one kernel (``linear_cross_entropy_logits_grad``: two reads of the logits, one write
of the gradient in hidden's dtype), which is folded into ``d_hidden`` and ``d_weight`` (accumulated
in fp32) a group of chunks at a time. With ``reduction="mean"`` or ``"sum"`` the gradients are
computed in the forward (the backward only scales them by the incoming gradient: three GEMMs in all,
as an unfused step); with ``"none"`` the backward recomputes each chunk's logits and weighs the
rows by the incoming per-token gradient. Peak extra memory: one chunk's logits, a group's logit
gradients and the fp32 weight gradient, which is saved for the backward as it is (the backward scales
and rounds it to the weight's dtype in one pass).

CPU and CUDA (the GEMMs are mmfuse's dual GEMM, bf16 / fp16 in with fp32 out on the GPU); a
registered op (``torch.ops.mmfuse.linear_cross_entropy``) with a fake kernel and autograd.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _lib  # noqa: F401  (registers the ops)

_REDUCTIONS = ("mean", "sum", "none")
# tokens whose logit gradients the weight gradient's GEMM takes at once (whole chunks, at least one):
# its fp32 [V, H] accumulator is read and written once a group, for the group's gradients held in
# hidden's dtype (1.2 GB at 4096 tokens of a 151936 vocabulary)
DW_GROUP_TOKENS = 4096
# d_hidden's GEMM a chunk at a time, each right after its chunk's logit gradients are written; True:
# over a group's at once (held for d_weight's anyway): 1.4 ms slower at T 16384, V 151936 (bench row)
DH_PER_GROUP = False


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], fp32: bool) -> Tensor:
    """h [C, H] @ w[V, H]^T (+ b): with ``fp32`` in fp32 (fp32 accumulation, fp32 out), else in h's dtype
    (as F.linear)."""
    if h.dtype in (torch.float32, torch.float64):
        z = h @ w.t()
    elif not fp32:
        return torch.nn.functional.linear(h, w, b)
    else:
        z = torch.ops.mmfuse.dual_gemm(h, w, h[:0], w, False, True, True)[0]
    return z if b is None else z + b.float()


def _dw_dtype(dtype: torch.dtype, dw_fp32: bool) -> torch.dtype:
    """The weight gradient's accumulator: fp32 (or hidden's dtype without dw_fp32); fp64 stays fp64."""
    return torch.float32 if dw_fp32 and dtype != torch.float64 else dtype


def _chunk_grad(z: Tensor, y: Tensor, valid: Tensor, label_smoothing: float, z_loss: float, softcap: float):
    """For fp32 logits z [C, V] (raw, before the softcap) and labels y [C]: (the per-token loss [C] and
    the gradient of the per-token loss w.r.t. z, in z's storage). Rows not `valid` get loss 0 and
    gradient 0."""
    V = z.shape[1]
    if softcap > 0:
        t = torch.tanh(z / softcap)
        zc = softcap * t
    else:
        zc = z
    lse = torch.logsumexp(zc, dim=1)
    yc = y.clamp(0, V - 1)
    picked = zc.gather(1, yc[:, None])[:, 0]
    loss = (1 - label_smoothing) * (lse - picked)
    if label_smoothing > 0:
        loss = loss + label_smoothing * (lse - zc.mean(dim=1))
    if z_loss > 0:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    # d loss / d zc = softmax * (1 + 2 z_loss lse) - (1 - eps) onehot - eps / V
    g = torch.exp(zc - lse[:, None])
    if z_loss > 0:
        g = g * (1 + 2 * z_loss * lse)[:, None]
    if label_smoothing > 0:
        g = g - label_smoothing / V
    g.scatter_add_(1, yc[:, None], torch.full_like(lse[:, None], -(1 - label_smoothing)))
    if softcap > 0:
        g = g * (1 - t.square())
    g = g * valid[:, None].to(g.dtype)
    return loss, g


def _passes(hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, chunk, row_weight,
            need_grads, fp32_logits=True, dw_fp32=True):
    """One pass over the token chunks: the per-token losses [T] (fp32), and where need_grads the
    gradients of sum_t row_weight[t] * loss[t] (d_hidden in hidden's dtype, d_bias fp32, d_weight fp32 or,
    without dw_fp32, accumulated in hidden's dtype)."""
    T, H = hidden.shape
    V = weight.shape[0]
    losses = torch.empty(T, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if need_grads else hidden.new_empty(0, H)
    acc = _dw_dtype(hidden.dtype, dw_fp32)
    fused = hidden.dtype != torch.float64  # the fused kernel (fp32 or 16-bit logits); fp64 (gradcheck): PyTorch ops
    if not need_grads:
        dw = hidden.new_empty(0, H, dtype=acc)
    elif fused and T > 0:  # the first group's GEMM writes it: no zero fill (1.2 GB at 151936 x 2048 fp32)
        dw = torch.empty(V, H, dtype=acc, device=hidden.device)
    else:
        dw = torch.zeros(V, H, dtype=acc, device=hidden.device)
    db = torch.zeros(V, dtype=torch.float32, device=hidden.device) if need_grads and bias is not None \
        else hidden.new_empty(0, dtype=torch.float32)
    group = chunk * (max(1, DW_GROUP_TOKENS // chunk) if fused else 1)
    g_buf = hidden.new_empty(min(group, T), V) if need_grads and fused else None
    per_group = DH_PER_GROUP
    for i0 in range(0, T, group):
        i1 = min(i0 + group, T)
        for i in range(i0, i1, chunk):
            j = min(i + chunk, i1)
            h, y = hidden[i:j], labels[i:j]
            z = _logits(h, weight, bias, fp32_logits)
            rw = (row_weight[i:j] if row_weight.dim() else row_weight.expand(j - i)).float().contiguous()
            if fused and need_grads:
                gd = g_buf[i - i0:j - i0]
                loss = torch.ops.mmfuse.linear_cross_entropy_logits_grad_out(z, y, rw, ignore_index, label_smoothing,
                                                                             z_loss, softcap, gd)
            elif fused:
                loss = torch.ops.mmfuse.linear_cross_entropy_logits_grad(z, y, rw, ignore_index, label_smoothing,
                                                                         z_loss, softcap, hidden.dtype, False)[0]
            else:
                loss, g = _chunk_grad(z, y, y != ignore_index, label_smoothing, z_loss, softcap)
                gd = (g * rw[:, None]).to(hidden.dtype)
                del g
            del z  # before the next chunk's logits are made
            losses[i:j] = loss
            if not need_grads or (fused and per_group):
                continue
            if bias is not None:
                db += gd.float().sum(0)
            torch.matmul(gd, weight, out=dh[i:j])
            if not fused:
                dw += (gd.t() @ h).to(dw.dtype)
        if need_grads and fused:
            gg, hh = g_buf[:i1 - i0], hidden[i0:i1]
            if per_group:
                if bias is not None:
                    db += gg.float().sum(0)
                torch.matmul(gg, weight, out=dh[i0:i1])
            first = i0 == 0
            if hidden.dtype == torch.float32 or not dw_fp32:
                # into the accumulator (fp32 sums, one rounding to its dtype), no temporary
                torch.mm(gg.t(), hh, out=dw) if first else dw.addmm_(gg.t(), hh)
            else:  # fp32 accumulation into dw: the dual GEMM's accumulate (g^T @ h)
                empty = gg[:0, :0]
                torch.ops.mmfuse.dual_gemm_out(gg, hh, empty, empty, dw, dw[:0, :0], True, False, not first)
    return losses, dh, dw, db


def _check(hidden, weight, labels, bias, reduction, label_smoothing, z_loss, softcap, chunk):
    op = "mmfuse.linear_cross_entropy"
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: expected hidden [T, H] and weight [V, H] with the same H, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype:
        raise ValueError(f"{op}: weight: expected dtype {hidden.dtype} (that of hidden), got {weight.dtype}")
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0] or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: labels: expected int64 [{hidden.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: logit_softcap: expected a positive cap or None, got {softcap}")
    if bias is not None and (bias.dtype != hidden.dtype or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"{op}: bias: expected {hidden.dtype} [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    if not 0 <= label_smoothing < 1 or z_loss < 0 or chunk < 1:
        raise ValueError(f"{op}: expected 0 <= label_smoothing < 1, z_loss >= 0 and chunk_tokens >= 1, got "
                         f"{label_smoothing}, {z_loss}, {chunk}")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, logit_softcap: Optional[float] = None,
                         chunk_tokens: int = 1024, logits_dtype: Optional[torch.dtype] = None,
                         weight_grad_dtype: Optional[torch.dtype] = torch.float32) -> Tensor:
    r"""``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` without the logits in memory.

    Args:
        hidden: ``[T, H]`` (or ``[..., H]``, flattened) bf16, fp16, fp32 (fp64 on the CPU).
        weight: ``[V, H]``, hidden's dtype (an LM head: ``lm_head.weight``).
        labels: int64 / int32 of hidden's leading shape (or, for a hidden ``[..., H]`` of more dims, its
            tokens flattened); ``ignore_index`` entries add no loss and no gradient.
        bias: ``[V]`` or None.
        reduction: ``"mean"`` (over the tokens not ignored; 0 with zero gradients where every token is
            ignored or there is none, where PyTorch's is NaN: 0 / 0), ``"sum"`` or ``"none"`` (per
            token, fp32).
        label_smoothing: as ``F.cross_entropy``'s.
        z_loss: adds ``z_loss * logsumexp(logits)^2`` a token (PaLM's auxiliary loss).
        logit_softcap: ``softcap * tanh(logits / softcap)`` before the softmax (Gemma 2), or None.
        logits_dtype: hidden's dtype (or None, the default): each chunk's logits made in it, as ``F.linear``
            does, then read in fp32 (the unfused step's own numerics); ``torch.float32``: made in fp32
            (a finer loss than the unfused step's, twice the logits' memory traffic).
        weight_grad_dtype: the weight gradient's accumulator over the chunks. ``torch.float32`` (default):
            fp32 sums, rounded to the weight's dtype once; hidden's dtype (or None): accumulated in it, as
            Liger-Kernel does (the GEMM's fp32 sums added to it and rounded once a group of 4096 tokens,
            so up to ``T / 4096`` roundings), for ``V * H * 4`` bytes less peak memory and half the
            accumulator's traffic.
        chunk_tokens: tokens a chunk; peak extra memory is about ``chunk_tokens * V`` elements of the
            logits' dtype (one chunk's logits), ``4096 * V`` elements of hidden's dtype (the logit
            gradients of a group of chunks, which the weight gradient's GEMM takes together) and the
            fp32 weight gradient ``V * H * 4`` bytes.

    Returns:
        The loss (fp32): a scalar, or ``[T]`` with ``reduction="none"``. Differentiable in hidden,
        weight and bias.
    """
    lead = hidden.shape[:-1]
    if tuple(labels.shape) != tuple(lead) and not (labels.dim() == 1 and hidden.dim() > 2):
        raise ValueError(f"mmfuse.linear_cross_entropy: labels: expected hidden's leading shape {tuple(lead)} (or "
                         f"its tokens flattened), got {tuple(labels.shape)}")
    h2 = hidden.reshape(-1, hidden.shape[-1]) if hidden.dim() else hidden
    y2 = labels.reshape(-1)
    _check(h2, weight, y2, bias, reduction, label_smoothing, z_loss, logit_softcap, chunk_tokens)
    softcap = float(logit_softcap) if logit_softcap is not None else 0.0
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if logits_dtype not in (None, torch.float32, hidden.dtype):
        raise ValueError(f"mmfuse.linear_cross_entropy: logits_dtype: expected torch.float32 or hidden's dtype "
                         f"{hidden.dtype}, got {logits_dtype}")
    fp32 = logits_dtype == torch.float32
    if weight_grad_dtype not in (None, torch.float32, hidden.dtype):
        raise ValueError(f"mmfuse.linear_cross_entropy: weight_grad_dtype: expected torch.float32 or hidden's dtype "
                         f"{hidden.dtype}, got {weight_grad_dtype}")
    loss = torch.ops.mmfuse.linear_cross_entropy(h2, weight, y2.long(), bias, ignore_index, reduction,
                                                 float(label_smoothing), float(z_loss), softcap, int(chunk_tokens),
                                                 grads, fp32, weight_grad_dtype == torch.float32)[0]
    return loss.view(lead) if reduction == "none" else loss


def _check_labels_cpu(labels, V, ignore_index):
    """Names the first bad label by its index in the call (the kernel sees one chunk at a time and would
    name its row in the chunk). CPU only: on CUDA the kernel's device assertion stops the step, no sync."""
    bad = ((labels < 0) | (labels >= V)) & (labels != ignore_index)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"mmfuse.linear_cross_entropy: labels[{i}] = {int(labels[i])}: expected a class in "
                         f"[0, {V}) or ignore_index {ignore_index}")


def _impl(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk,
          compute_grads, fp32_logits=True, dw_fp32=True):
    """(loss, d_hidden, d_weight, d_bias): for mean / sum with compute_grads, the gradients of the loss;
    else empty (with "none" the backward recomputes)."""
    need = reduction != "none" and compute_grads
    if labels.device.type == "cpu":
        _check_labels_cpu(labels, weight.shape[0], ignore_index)
    n_valid = (labels != ignore_index).sum().clamp_min(1).to(torch.float32)
    scale = 1.0 / n_valid if reduction == "mean" else torch.ones((), device=hidden.device)
    with torch.no_grad():
        losses, dh, dw, db = _passes(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                                     labels, ignore_index, label_smoothing, z_loss, softcap, chunk, scale, need,
                                     fp32_logits, dw_fp32)
    loss = losses if reduction == "none" else (losses.sum() * scale)
    # the weight gradient as accumulated (fp32 by default): the backward scales it by the incoming
    # gradient and rounds it to the weight's dtype in one pass, where a rounding here and a scaling
    # there made three (0.6 GB more held between them at an LM head of 151936 x 2048)
    return loss, dh, dw, db


@torch.library.register_fake("mmfuse::linear_cross_entropy")
def _fake(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk,
          compute_grads, fp32_logits=True, dw_fp32=True):
    T, H = hidden.shape
    V = weight.shape[0]
    loss = hidden.new_empty(T if reduction == "none" else (), dtype=torch.float32)
    grads = reduction != "none" and compute_grads
    acc = _dw_dtype(hidden.dtype, dw_fp32)
    return (loss, hidden.new_empty(T if grads else 0, H), hidden.new_empty(V if grads else 0, H, dtype=acc),
            hidden.new_empty(V if grads and bias is not None else 0, dtype=torch.float32))


@torch.library.register_fake("mmfuse::linear_cross_entropy_logits_grad")
def _logits_grad_fake(z, labels, row_scale, ignore_index, label_smoothing, z_loss, softcap, g_dtype, want_grad):
    C, V = z.shape
    return z.new_empty(C, dtype=torch.float32), z.new_empty(C if want_grad else 0, V, dtype=g_dtype)


@torch.library.register_fake("mmfuse::linear_cross_entropy_logits_grad_out")
def _logits_grad_out_fake(z, labels, row_scale, ignore_index, label_smoothing, z_loss, softcap, g):
    return z.new_empty(z.shape[0], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk = inputs[:10]
    fp32, dw32 = (tuple(inputs[11:]) + (True, True))[:2]  # the defaults where a caller left them out
    _, dh, dw, db = output
    ctx.params = (ignore_index, reduction, label_smoothing, z_loss, softcap, chunk, fp32, dw32)
    ctx.has_bias = bias is not None
    # the gradients computed in the forward are outputs no loss uses: None to the backward, not zero-filled
    # [T, H] and fp32 [V, H] "gradients" of them (1.2 GB written at an LM head of 151936 x 2048)
    ctx.set_materialize_grads(False)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, bias)
    else:
        ctx.save_for_backward(dh, dw, db, weight, bias)


def _backward(ctx, grad_loss, _gdh, _gdw, _gdb):
    ignore_index, reduction, label_smoothing, z_loss, softcap, chunk, fp32, dw32 = ctx.params
    if grad_loss is None:  # only the gradient outputs were used: they are not differentiable
        return (None,) * 13
    if reduction == "none":
        hidden, weight, labels, bias = ctx.saved_tensors
        with torch.no_grad():
            _, dh, dw, db = _passes(hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, chunk,
                                    grad_loss.float(), True, fp32, dw32)
        return dh, dw.to(weight.dtype), None, (db.to(bias.dtype) if ctx.has_bias else None), *([None] * 9)
    dh, dw, db, weight, bias = ctx.saved_tensors
    s = grad_loss.float()
    # the weight gradient scaled and rounded to the weight's dtype in one pass, into a new tensor: the
    # saved one stays as it is for a retained graph
    dw_out = torch.mul(dw, s, out=torch.empty(dw.shape, dtype=weight.dtype, device=dw.device))
    return dh * s, dw_out, None, (db * s).to(bias.dtype) if ctx.has_bias else None, *([None] * 9)


torch.library.register_autograd("mmfuse::linear_cross_entropy", _backward, setup_context=_setup_context)
torch.library.impl("mmfuse::linear_cross_entropy", ("cpu", "cuda"))(_impl)
