"""FP8 linear layers for training (SEMANTICS.md section 7).

``y = x @ w^T + b`` with x and w quantized to e4m3 on the device, an fp8 GEMM with fp32 accumulation
and a bf16 result; the backward quantizes the output gradient once (e5m2 by default, or e4m3) and
computes dX and dW with fp8 GEMMs from the transposed fp8 copies of w and x that the forward saved
(never the bf16 x), or dW in bf16 as an option. Per-tensor scaling: ``scale = fp8_max / max(amax,
1e-12)``; ``scale_inv = 1 / scale`` is what the GEMM multiplies back. Nothing reads device data on the
host: the whole layer is capturable in a CUDA graph.

Scale state: a float32 tensor ``[history + 2]`` (:func:`new_state`): the amax history, newest first,
and two words of scratch the kernels leave at zero. "dynamic" scaling uses the tensor's own amax (one
extra read of it); "delayed" scaling uses the history's maximum and records the new amax in the same
pass (one read; values past the delayed range saturate). States belong to their owner (a module);
never share one between concurrent calls.

Layers: :func:`fp8_quantize`, :func:`fp8_gemm` (CPU emulation and CUDA/cuBLASLt), :func:`fp8_linear`
(autograd), :class:`mmfuse.nn.Fp8Linear`. Seed-compatible: :func:`fp8_mm`, :func:`fp8_linear_forward`,
:func:`fp8_linear_backward`, :func:`fp8_available`.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import _lib  # noqa: F401  (registers the ops)

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
DEFAULT_HISTORY = 16


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def new_state(history: int = DEFAULT_HISTORY, device=None) -> Tensor:
    """A fresh (zero) amax state of ``history`` entries."""
    if history < 1:
        raise ValueError(f"mmfuse.fp8.new_state: history: expected >= 1, got {history}")
    return torch.zeros(history + 2, dtype=torch.float32, device=device)


class Fp8Quantized(NamedTuple):
    """``q [pad16(R), pad16(C)]`` and / or ``qt [pad16(C), pad16(R)]`` (empty where not asked for; the
    padding is zero); ``scale_inv``: q's inverse scales (``[1]``, or per row ``[pad16(R)]``),
    ``scale_inv_t``: qt's (the same tensor per tensor; per row ``[pad16(C)]``, one a column of x)."""

    q: Tensor
    qt: Tensor
    scale_inv: Tensor
    scale_inv_t: Tensor


def _quantized(q, qt, si, si_t) -> Fp8Quantized:
    return Fp8Quantized(q, qt, si, si_t if si_t.numel() else si)


def fp8_quantize(x: Tensor, state: Optional[Tensor] = None, *, rowwise: bool = True, transposed: bool = False,
                 dtype: torch.dtype = E4M3, dynamic: bool = True, per_row: bool = False) -> Fp8Quantized:
    """Quantizes ``x [..., C]`` (bf16, fp16 or fp32; flattened to ``[R, C]``) to fp8 in one pass.

    ``q = saturate(round_nearest_even(x * scale))``, ``scale = fp8_max / amax`` with amax over the
    finite values of x (an Inf or NaN element becomes NaN in q: the outputs that read it are
    non-finite, the others exact; the history records the finite amax), written row-major (``rowwise``) and / or transposed
    (``transposed``), both dims zero-padded to a multiple of 16. ``state``: the amax state (updated in
    place); None: a fresh one. ``dynamic=False`` (delayed): scaled by the history's maximum, or by
    x's own amax when the history is fresh (all zero). ``per_row``: a scale for every row of q (its
    row's amax) and every row of qt (that column's amax), always dynamic; ``state`` is unused. Bitwise
    equal on the CPU and the GPU.
    """
    if dtype not in (E4M3, E5M2):
        raise ValueError(f"mmfuse.fp8_quantize: dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if x.dim() == 0:
        raise ValueError(f"mmfuse.fp8_quantize: x: expected a tensor of at least 1 dim [..., C], got a 0-d tensor")
    if state is None:
        state = new_state(1, x.device)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if per_row and not dynamic:
        raise ValueError("mmfuse.fp8_quantize: per_row=True: scales per row are always dynamic (dynamic=False is "
                         "per tensor only)")
    return _quantized(*torch.ops.mmfuse.fp8_quantize(x2, state, rowwise, transposed, dtype == E5M2, dynamic, per_row))


def fp8_gemm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor] = None,
             out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = True) -> Tensor:
    """``(a @ b^T) * scale_a * scale_b (+ bias)``: a ``[M, K]``, b ``[N, K]`` fp8 (K and N multiples of 16,
    as :func:`fp8_quantize` pads them: slice the result to the real columns; at most one of a and b
    e5m2), scales both float32 ``[1]``, or both per row (``scale_a`` >= M entries, ``scale_b`` N:
    ``out[i, j] = acc * scale_a[i] * scale_b[j]``), bias bf16 ``[N]``; fp32 accumulation; result
    ``[M, N]`` bf16 or fp32."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"mmfuse.fp8_gemm: out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    return torch.ops.mmfuse.fp8_gemm(a, b, scale_a, scale_b, bias, out_dtype == torch.float32, fast_accum)


# ---- when fp8 pays -----------------------------------------------------------------------------

# Smallest m * n * k of a linear layer that runs in fp8 on the GPU; below it the layer runs in bf16
# (F.linear), where the quantize passes and the launches cost more than the faster GEMM saves
# (docs/design/fp8.md gives the measured crossover).
FP8_MIN_MNK = 4096 ** 3


def fp8_pays(m: int, n: int, k: int) -> bool:
    """Whether a linear of ``[m, k] x [n, k]^T`` runs faster in fp8 than in bf16 (CUDA; measured)."""
    return m * n * k >= FP8_MIN_MNK


# ---- autograd ----------------------------------------------------------------------------------

class _Fp8LinearFn(torch.autograd.Function):
    """x2 [M, K], w [N, K], bias [N] -> y [M, N]. Outputs 1-4: w's fp8 copies and their inverse
    scales when they were made here (for the caller's cache), else empty."""

    @staticmethod
    def forward(ctx, x2, w, bias, x_state, w_state, g_state, w_q, w_qt, w_si, w_si_t, dynamic, grad_e5m2,
                bf16_wgrad, main_grad, keep_wt, per_row):
        need_dx, need_dw = x2.requires_grad, w.requires_grad
        save_xt = need_dw and not bf16_wgrad
        y, x_qt, x_si, nq, nqt, nsi, nsi_t = torch.ops.mmfuse.fp8_linear_forward(
            x2, w, bias, x_state, w_state, w_q, w_qt, w_si, dynamic, save_xt, need_dx or keep_wt, per_row)
        if w_q is None:
            w_qt, w_si_t = nqt, (nsi_t if per_row else nsi)
        ctx.save_for_backward(x_qt, x_si, w_qt, w_si_t, g_state, x2 if (need_dw and bf16_wgrad) else None, main_grad)
        ctx.grad_e5m2 = grad_e5m2
        ctx.dynamic = dynamic
        ctx.per_row = per_row
        ctx.k = x2.shape[1]
        ctx.mark_non_differentiable(nq, nqt, nsi, nsi_t)
        ctx.set_materialize_grads(False)  # else autograd fills zero "gradients" of w's fp8 copies every step
        return y, nq, nqt, nsi, nsi_t

    @staticmethod
    def backward(ctx, gy, _gq, _gqt, _gsi, _gsit):
        if gy is None:  # y took no part in the loss
            return (None,) * 16
        x_qt, x_si, w_qt, w_si, g_state, x2, main_grad = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if main_grad is not None and not need_dw:
            main_grad = None
        dx, dw, db = torch.ops.mmfuse.fp8_linear_backward(
            gy.to(torch.bfloat16), x_qt, x_si, w_qt, w_si, g_state, ctx.k, ctx.dynamic, ctx.grad_e5m2, need_dx, need_dw,
            need_db, False, main_grad, x2, ctx.per_row)
        dw_out = None if (not need_dw or main_grad is not None) else dw
        return (dx if need_dx else None, dw_out, db if need_db else None) + (None,) * 13


def _check_linear(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{op}: x: expected a floating-point tensor (as nn.Linear), got {x.dtype}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"{op}: x and weight: expected bfloat16, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: expected x [..., K] and weight [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"{op}: bias: expected bfloat16 [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")


def fp8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, x_state: Optional[Tensor] = None,
               w_state: Optional[Tensor] = None, g_state: Optional[Tensor] = None, scaling: str = "dynamic",
               weight_fp8: Optional[Fp8Quantized] = None, grad_dtype: torch.dtype = E5M2, bf16_wgrad: bool = False,
               main_grad: Optional[Tensor] = None, return_weight_fp8: bool = False, recipe: str = "tensor"):
    """``F.linear(x, weight, bias)`` in fp8, differentiable in x, weight and bias.

    Args:
        x: ``[..., K]`` bf16. weight: ``[N, K]`` bf16. bias: ``[N]`` bf16 or None.
        x_state, w_state, g_state: amax states (:func:`new_state`); None: fresh ones (dynamic scaling).
        scaling: ``"dynamic"``: x and the output gradient scaled by their own amax (a second read of
            each); ``"delayed"``: by the maximum of their states' histories (one pass each; the first
            call on a fresh state is exact, decided on the device). w is always scaled dynamically.
        recipe: ``"tensor"`` (default): one scale a tensor; ``"row"``: one scale a row of each fp8
            copy (x's and the gradient's rows and columns, w's rows and columns; always dynamic, so
            ``scaling`` must be ``"dynamic"``): more accurate, one more memset a quantize.
        weight_fp8: w's fp8 copies from an earlier call (``return_weight_fp8``), reused instead of
            quantizing w again (gradient accumulation over micro-batches of one optimizer step).
        grad_dtype: the output gradient's format, e5m2 (default, more range) or e4m3 (more precision).
        bf16_wgrad: dW in bf16 from the bf16 x (saved instead of its fp8 copy).
        main_grad: an fp32 ``[N, K]`` buffer that dW is added to (then weight gets no ``.grad``).
        return_weight_fp8: also return w's fp8 copies (both of them, for reuse with ``weight_fp8``).

    Returns:
        y ``[..., N]`` bf16, and with ``return_weight_fp8`` also w's new fp8 copies (None when given).
    """
    _check_linear("mmfuse.fp8_linear", x, weight, bias)
    if scaling not in ("dynamic", "delayed"):
        raise ValueError(f"mmfuse.fp8_linear: scaling: expected 'dynamic' or 'delayed', got {scaling!r}")
    if recipe not in ("tensor", "row"):
        raise ValueError(f"mmfuse.fp8_linear: recipe: expected 'tensor' or 'row', got {recipe!r}")
    if recipe == "row" and scaling != "dynamic":
        raise ValueError("mmfuse.fp8_linear: recipe='row' scales are always dynamic: expected scaling='dynamic', "
                         f"got {scaling!r}")
    if grad_dtype not in (E4M3, E5M2):
        raise ValueError(f"mmfuse.fp8_linear: grad_dtype: expected torch.float8_e5m2 or torch.float8_e4m3fn, got "
                         f"{grad_dtype}")
    n, k = weight.shape
    if weight_fp8 is not None:
        want = {"q": (_pad16(n), _pad16(k)), "qt": (_pad16(k), _pad16(n))}
        for name, t in (("q", weight_fp8.q), ("qt", weight_fp8.qt)):
            if t is not None and t.numel() and tuple(t.shape) != want[name]:
                raise ValueError(f"mmfuse.fp8_linear: weight_fp8: its {name} is {tuple(t.shape)}, expected {want[name]} "
                                 f"for a weight of {(n, k)}: a cache of another weight")
    if main_grad is not None and (tuple(main_grad.shape) != (n, k) or main_grad.dtype != torch.float32):
        raise ValueError(f"mmfuse.fp8_linear: main_grad: expected float32 {(n, k)} (the weight's shape), got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    dev = x.device
    x_state = new_state(1, dev) if x_state is None else x_state
    w_state = new_state(1, dev) if w_state is None else w_state
    g_state = new_state(1, dev) if g_state is None else g_state
    wq = weight_fp8 if weight_fp8 is not None else Fp8Quantized(None, None, None, None)
    per_row = recipe == "row"
    y, nq, nqt, nsi, nsi_t = _Fp8LinearFn.apply(
        x.reshape(-1, x.shape[-1]), weight, bias, x_state, w_state, g_state, wq.q, wq.qt, wq.scale_inv,
        wq.scale_inv_t, scaling == "dynamic", grad_dtype == E5M2, bf16_wgrad, main_grad, return_weight_fp8, per_row)
    if x.dim() != 2:  # a 2-D x gets the op's own output, not a view of it (in-place ops on it stay cheap)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
    if not return_weight_fp8:
        return y
    return y, (None if weight_fp8 is not None else _quantized(nq, nqt, nsi, nsi_t))


# ---- seed-compatible functions -----------------------------------------------------------------

def fp8_available() -> bool:
    """True where fp8 GEMMs run on the GPU: a CUDA build of mmfuse on a device of compute capability 8.9+."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def fp8_mm(a: Tensor, b: Tensor, sx: Tensor, sw: Tensor) -> Tensor:
    """Seed signature: ``a [M, K]``, ``b [N, K]`` e4m3, already divided by the scalars ``sx`` / ``sw``
    (so ``x = a * sx``, ``w = b * sw``); returns ``x @ w^T`` in fp32 ``[M, N]`` = ``(a @ b^T) * sx * sw``
    (the seed's kernel ignored the scales, and its fake had the wrong shape). Any K (padded here when it
    is not a multiple of 16). Not differentiable: fp8 operands carry no gradient (use :func:`fp8_linear`)."""
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in (E4M3, E5M2) or t.dim() != 2:
            raise ValueError(f"mmfuse.fp8_mm: {name}: expected a 2-D float8 tensor, got {t.dtype} {tuple(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"mmfuse.fp8_mm: b: expected {a.shape[1]} columns (the K of a), got {tuple(b.shape)}")
    k, n = a.shape[1], b.shape[0]
    if k % 16 or not a.is_contiguous():
        a = _pad(a, a.shape[0])
    if k % 16 or n % 16 or not b.is_contiguous():
        b = _pad(b, _pad16(n))
    for name, t in (("sx", sx), ("sw", sw)):
        if t.numel() != 1:
            raise ValueError(f"mmfuse.fp8_mm: {name}: expected one scalar scale (a tensor of 1 element), got shape "
                             f"{tuple(t.shape)}")
    sx = sx.to(torch.float32).reshape(1)
    sw = sw.to(torch.float32).reshape(1)
    return torch.ops.mmfuse.fp8_gemm(a, b, sx, sw, None, True, False)[:, :n]


def _pad(t: Tensor, rows: int) -> Tensor:
    """t in a zero [rows, pad16(K)] buffer."""
    out = torch.zeros(rows, _pad16(t.shape[1]), dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.contiguous().view(torch.uint8)
    return out.view(t.dtype)


_SCRATCH: dict = {}


def _scratch_states(dev: torch.device, n: int) -> Tuple[Tensor, ...]:
    """n one-entry amax states for a dynamically scaled call, made once a (device, stream): dynamic
    scaling overwrites the entry and the kernels leave the scratch words at zero, so calls in stream
    order can share them (the seed functions' per-call allocations go)."""
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (dev, stream, n)
    states = _SCRATCH.get(key)
    if states is None:
        states = _SCRATCH[key] = tuple(new_state(1, dev) for _ in range(n))
    return states


def _placeholders(dev: torch.device) -> Tuple[Tensor, Tensor]:
    """An empty e4m3 tensor and a float32 1 on dev (read only: the operands a call does not use)."""
    key = (dev, "placeholders")
    p = _SCRATCH.get(key)
    if p is None:
        p = _SCRATCH[key] = (torch.empty(0, dtype=E4M3, device=dev), torch.ones(1, dtype=torch.float32, device=dev))
    return p


def _plain_pays(x2: Tensor, w: Tensor) -> bool:
    """Fp8Linear's rule for the seed functions: fp8 on the GPU where it pays (fp8_pays); the CPU
    emulates fp8 always."""
    return not x2.is_cuda or fp8_pays(x2.shape[0], w.shape[0], w.shape[1])


def fp8_linear_forward(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, *, fallback: bool = True) -> Tensor:
    """Seed signature: ``F.linear(x, w, bias)`` in fp8 (x ``[..., K]``, w ``[N, K]`` bf16), dynamic scaling,
    quantize (x and w in one launch) + GEMM with the bias in its epilogue. Not differentiable itself
    (pair with :func:`fp8_linear_backward`, or use :func:`fp8_linear`). ``fallback`` (default, as
    :class:`mmfuse.nn.Fp8Linear`): on the GPU a shape where fp8 does not pay (:func:`fp8_pays`) runs as
    bf16 ``F.linear``."""
    if bias is not None and bias.numel() == 0:  # the seed's "no bias"
        bias = None
    _check_linear("mmfuse.fp8_linear_forward", x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if fallback and not _plain_pays(x2, w):
        return F.linear(x, w, bias)
    xs, ws = _scratch_states(x.device, 2)
    y = torch.ops.mmfuse.fp8_linear_forward(x2, w, bias, xs, ws, None, None, None, True, False, False)[0]
    return y.reshape(*x.shape[:-1], w.shape[0])


def fp8_linear_backward(g: Tensor, x: Tensor, w: Tensor, masks: Sequence[bool], *,
                        fallback: bool = True) -> Tuple[Optional[Tensor], ...]:
    """Seed signature: ``(dx, dw, db)`` of ``y = F.linear(x, w, b)`` for the output gradient ``g [..., N]``,
    each computed where ``masks`` (three bools) asks for it, else None. x and w are quantized again
    (dynamic scaling), g in e5m2; dX and dW are fp8 GEMMs; dtypes follow x. ``fallback``: as
    :func:`fp8_linear_forward` (bf16 GEMMs where fp8 does not pay)."""
    if len(masks) != 3:
        raise ValueError(f"mmfuse.fp8_linear_backward: masks: expected 3 bools (dx, dw, db), got {list(masks)}")
    _check_linear("mmfuse.fp8_linear_backward", x, w, None)
    if tuple(g.shape) != tuple(x.shape[:-1]) + (w.shape[0],):
        raise ValueError(f"mmfuse.fp8_linear_backward: g: expected shape {tuple(x.shape[:-1]) + (w.shape[0],)} (x's "
                         f"leading dims and w's N), got {tuple(g.shape)}")
    need_dx, need_dw, need_db = (bool(m) for m in masks)
    dev = x.device
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, w.shape[0])
    if fallback and not _plain_pays(x2, w):
        gx = g2.to(x.dtype)
        return (gx.mm(w.to(x.dtype)).reshape(x.shape) if need_dx else None,
                gx.t().mm(x2).to(w.dtype) if need_dw else None,
                gx.float().sum(0).to(x.dtype) if need_db else None)
    g2 = g2.to(torch.bfloat16)
    g_state, x_state, w_state = _scratch_states(dev, 3)
    xq = fp8_quantize(x2, x_state, rowwise=False, transposed=True) if need_dw else None
    wq = fp8_quantize(w, w_state, rowwise=False, transposed=True) if need_dx else None
    empty8, one = _placeholders(dev)
    dx, dw, db = torch.ops.mmfuse.fp8_linear_backward(
        g2, xq.qt if xq else empty8, xq.scale_inv_t if xq else one, wq.qt if wq else empty8,
        wq.scale_inv_t if wq else one, g_state, x.shape[-1], True, True, need_dx, need_dw, need_db, False, None, None)
    return (dx.reshape(x.shape) if need_dx else None, dw if need_dw else None, db if need_db else None)


# ---- fakes -------------------------------------------------------------------------------------

def _strided_out(a: Tensor, m: int, n: int, dtype: torch.dtype) -> Tensor:
    return a.new_empty_strided((m, n), (_pad16(n), 1), dtype=dtype)


@torch.library.register_fake("mmfuse::fp8_quantize")
def _fp8_quantize_fake(x, state, rowwise=True, transposed=False, e5m2=False, dynamic=True, per_row=False,
                       swiglu_q=None, swiglu_scale_inv=None):
    r, c = x.shape
    c = 2 * c if swiglu_q is not None else c
    dt = E5M2 if e5m2 else E4M3
    q = x.new_empty((_pad16(r), _pad16(c)) if rowwise else (0,), dtype=dt)
    qt = x.new_empty((_pad16(c), _pad16(r)) if transposed else (0,), dtype=dt)
    si = x.new_empty((_pad16(r) if per_row else 1,), dtype=torch.float32)
    return q, qt, si, x.new_empty((_pad16(c) if per_row and transposed else 0,), dtype=torch.float32)


@torch.library.register_fake("mmfuse::fp8_transpose")
def _fp8_transpose_fake(q):
    return q.new_empty((q.shape[1], q.shape[0]))


@torch.library.register_fake("mmfuse::fp8_gemm")
def _fp8_gemm_fake(a, b, scale_a, scale_b, bias=None, out_fp32=False, fast_accum=True):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32 if out_fp32 else torch.bfloat16)


@torch.library.register_fake("mmfuse::fp8_gemm_out")
def _fp8_gemm_out_fake(a, b, scale_a, scale_b, out, accumulate=False, fast_accum=False):
    return None


@torch.library.register_fake("mmfuse::fp8_linear_forward")
def _fp8_linear_forward_fake(x, w, bias, x_state, w_state, w_q=None, w_qt=None, w_scale_inv=None, dynamic=True,
                             save_xt=True, save_wt=True, per_row=False, swiglu_x=False):
    (m, k), n = x.shape, w.shape[0]
    k = k // 2 if swiglu_x else k
    f32 = torch.float32
    y = _strided_out(x, m, n, torch.bfloat16)
    x_qt = x.new_empty((_pad16(k), _pad16(m)) if save_xt else (0,), dtype=E4M3)
    x_si = x.new_empty(((_pad16(k) if per_row else 1) if save_xt else 0,), dtype=f32)
    if w_q is not None:
        e8, e32 = x.new_empty((0,), dtype=E4M3), x.new_empty((0,), dtype=f32)
        return y, x_qt, x_si, e8, e8.clone(), e32, e32.clone()
    wq = x.new_empty((_pad16(n), _pad16(k)), dtype=E4M3)
    wqt = x.new_empty((_pad16(k), _pad16(n)) if save_wt else (0,), dtype=E4M3)
    wsi = x.new_empty((_pad16(n) if per_row else 1,), dtype=f32)
    return y, x_qt, x_si, wq, wqt, wsi, x.new_empty((_pad16(k) if per_row and save_wt else 0,), dtype=f32)


@torch.library.register_fake("mmfuse::fp8_linear_backward")
def _fp8_linear_backward_fake(g, x_qt, x_scale_inv, w_qt, w_scale_inv, g_state, k, dynamic=True, e5m2=True,
                              need_dx=True, need_dw=True, need_db=False, dw_fp32=False, main_grad=None, x=None,
                              per_row=False, swiglu_q=None, swiglu_scale_inv=None):
    m, n = g.shape
    n = 2 * n if swiglu_q is not None else n
    dx = _strided_out(g, m, k, torch.bfloat16) if need_dx else g.new_empty((0,))
    if need_dw and main_grad is None:
        dt = torch.float32 if dw_fp32 else g.dtype
        dw = g.new_empty((n, k), dtype=dt) if x is not None else _strided_out(g, n, k, dt)
    else:
        dw = g.new_empty((0,))
    db = g.new_empty((n,)) if need_db else g.new_empty((0,))
    return dx, dw, db
