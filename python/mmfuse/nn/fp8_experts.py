"""The fp8 path of the two-expert SwiGLU modules (:class:`mmfuse.nn.vla.MoTExperts`,
:class:`mmfuse.nn.DualExpertMLP`): each expert's scaling states, the "fp8 only where it pays" rule of
:class:`mmfuse.nn.Fp8Linear` applied per expert, and the expert as one autograd function over mmfuse's
fp8 linear ops (``_Fp8ExpertFn``)."""

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import fp8 as _fp8
from ..swiglu import swiglu
from .fp32_buffers import Fp32Buffers

_PROJECTIONS = ("gate_up0", "down0", "gate_up1", "down1")


class Fp8Experts(Fp32Buffers):
    """Mixin of a module with parameters ``gate_up0``, ``down0``, ``gate_up1``, ``down1`` (``nn.Linear``
    layout, gate and up stacked): its fp8 states and the per-expert fp8 call."""

    _fp32_suffixes = ("_state",)  # the fp8 scaling states stay float32 when the module is cast

    def _init_fp8(self, fp8: bool, history: int, grad_dtype: torch.dtype, scaling: str) -> None:
        self._check_fp8_options(grad_dtype, scaling)
        self.fp8, self.grad_dtype, self.scaling = False, grad_dtype, scaling
        if fp8:
            self.enable_fp8(history=history, grad_dtype=grad_dtype, scaling=scaling)

    def _check_fp8_options(self, grad_dtype: torch.dtype, scaling: str) -> None:
        owner = type(self).__name__
        if scaling not in ("dynamic", "delayed"):
            raise ValueError(f"{owner}: scaling: expected 'dynamic' or 'delayed', got {scaling!r}")
        if grad_dtype not in (_fp8.E5M2, _fp8.E4M3):
            raise ValueError(f"{owner}: grad_dtype: expected torch.float8_e5m2 or torch.float8_e4m3fn, got {grad_dtype}")

    def enable_fp8(self, *, history: int = _fp8.DEFAULT_HISTORY, grad_dtype: torch.dtype = _fp8.E5M2,
                   scaling: str = "delayed") -> "Fp8Experts":
        """Runs each expert in fp8 where it pays from now on: new scaling states (``history`` amaxes of
        x and of the output gradient, delayed scaling; one for the weight), ``grad_dtype`` for the
        gradients. Returns the module."""
        self._check_fp8_options(grad_dtype, scaling)
        device = self.gate_up0.device
        for proj in _PROJECTIONS:
            for t, hist in (("x", history), ("w", 1), ("g", history)):
                self.register_buffer(f"{proj}_{t}_state", _fp8.new_state(hist, device), persistent=False)
        self.fp8, self.grad_dtype, self.scaling = True, grad_dtype, scaling
        return self

    def fp8_delayed_states(self) -> List[Tensor]:
        if not self.fp8 or self.scaling == "dynamic":
            return []
        return [getattr(self, f"{p}_{t}_state") for p in _PROJECTIONS for t in "xg"]

    def _uses_fp8(self, x: Tensor, rows: int, e: int) -> bool:
        if not self.fp8:
            return False
        w = getattr(self, f"gate_up{e}")
        return not x.is_cuda or _fp8.fp8_pays(rows, w.shape[0], w.shape[1])

    def _plain_expert(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` of ``x [M, hidden_e]`` in the parameters' dtype, on its own."""
        return F.linear(swiglu(F.linear(x, getattr(self, f"gate_up{e}"))), getattr(self, f"down{e}"))

    def _fp8_expert(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` of ``x [M, hidden_e]`` in fp8."""
        states = tuple(getattr(self, f"{p}{e}_{t}_state") for p in ("gate_up", "down") for t in "xwg")
        return _Fp8ExpertFn.apply(x, getattr(self, f"gate_up{e}"), getattr(self, f"down{e}"), states,
                                  self.grad_dtype == _fp8.E5M2, self.scaling == "dynamic")


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (activation checkpointing, offloading) are active, so that every saved
    tensor must go through save_for_backward; assumed so where this torch cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _Fp8ExpertFn(torch.autograd.Function):
    """One SwiGLU expert in fp8, x [M, H] -> y [M, H]: gate/up and down through mmfuse's fp8 linear ops
    (e4m3 operands, delayed or dynamic scaling), the SwiGLU activation quantized straight from the gate/up
    output (``swiglu_x``: it is never written in bf16). Saved for the backward: x's and the activation's
    fp8 copies and the gate/up output packed in fp8 (``swiglu_pack_fp8``: 128-column tiles with their own
    power-of-two scales, half the bytes of bf16), from which the backward's gate/up cast computes the
    SwiGLU gradient as it quantizes it (``fp8_quantize``'s ``swiglu_q``: never written in bf16).
    The weights' transposed fp8 copies are made again in the backward, each right before its GEMM.
    Eager, the pack and the activation's copy are held on ctx and let go as soon as read, the activation's
    before the gate/up backward makes its gradient copies (the step's peak); so a second backward
    through the same graph is refused. Traced, or under saved-tensor hooks (checkpointing, offloading),
    they are saved as usual."""

    # The gate/up projection's output gradient in fp8: its row-major copy cast from da and the pack,
    # then (da and the pack let go) its transposed copy by transposing that one, so neither copy
    # coexists with both da and the other (the step's peak); False: both copies in one cast pass inside
    # fp8_linear_backward (a transpose fewer, ~0.3 GB more at the peak at the 3B shapes).
    split_grad_copies = True

    @staticmethod
    def forward(ctx, x, gate_up, down, states, grad_e5m2, dynamic):
        gu_x, gu_w, gu_g, dn_x, dn_w, dn_g = states
        # the weights' transposed fp8 copies (the input-gradient GEMMs' operands) are not saved: the
        # backward makes them again from the weights, the same bits, one at a time
        g, x_qt, x_si, _, _, _, _ = torch.ops.mmfuse.fp8_linear_forward(
            x, gate_up, None, gu_x, gu_w, None, None, None, dynamic, True, False, False)
        y, a_qt, a_si, _, _, _, _ = torch.ops.mmfuse.fp8_linear_forward(
            g, down, None, dn_x, dn_w, None, None, None, dynamic, True, False, False, True)
        g_q, g_si = torch.ops.mmfuse.swiglu_pack_fp8(g)
        del g
        first = (g_q, g_si, a_qt, a_si)
        ctx.saved_all = torch.compiler.is_compiling() or _saved_tensor_hooks_active()
        kept = (x_qt, x_si, gate_up, down, gu_w, gu_g, dn_w, dn_g)
        if ctx.saved_all:
            ctx.save_for_backward(*kept, *first)
        else:
            ctx.save_for_backward(*kept)
            ctx.first = first
        ctx.grad_e5m2, ctx.dynamic, ctx.k = grad_e5m2, dynamic, (x.shape[1], down.shape[1])
        return y

    @staticmethod
    def backward(ctx, dy):
        x_qt, x_si, gate_up, down, gu_w, gu_g, dn_w, dn_g, *first = ctx.saved_tensors
        if not ctx.saved_all:
            if ctx.first is None:
                raise RuntimeError("mmfuse fp8 expert: its backward lets go of its saved tensors as it reads them: a "
                                   "second backward through the same graph (retain_graph=True) is not supported")
            first, ctx.first = list(ctx.first), None
        g_q, g_si, a_qt, a_si = first
        del first
        need_dx, need_dgu, need_ddn = ctx.needs_input_grad[:3]
        H, inter = ctx.k
        e5m2, dynamic = ctx.grad_e5m2, ctx.dynamic
        # a weight's transposed copy as the forward made it (dynamic, per tensor: the same scale and bits)
        _, dn_qt, dn_si, _ = torch.ops.mmfuse.fp8_quantize(down, dn_w, False, True, False, True, False)
        da, ddown, _ = torch.ops.mmfuse.fp8_linear_backward(
            dy.to(torch.bfloat16), a_qt, a_si, dn_qt, dn_si, dn_g, inter, dynamic, e5m2, True, need_ddn, False, False,
            None, None, False)
        del a_qt, a_si, dn_qt, dn_si
        # the SwiGLU gradient quantized straight from da and the pack (never written in bf16)
        if not _Fp8ExpertFn.split_grad_copies:
            _, gu_qt, gu_si, _ = torch.ops.mmfuse.fp8_quantize(gate_up, gu_w, False, True, False, True, False)
            dx, dgu, _ = torch.ops.mmfuse.fp8_linear_backward(
                da, x_qt, x_si, gu_qt, gu_si, gu_g, H, dynamic, e5m2, need_dx, need_dgu, False, False, None, None,
                False, g_q, g_si)
            return (dx if need_dx else None, dgu if need_dgu else None, ddown if need_ddn else None, None, None, None)
        dx = dgu = None
        if need_dx or need_dgu:
            M, two_i = g_q.shape
            q, _, q_si, _ = torch.ops.mmfuse.fp8_quantize(da, gu_g, True, False, e5m2, dynamic, False, g_q, g_si)
            del da, g_q, g_si
            if need_dx:
                _, gu_qt, gu_si, _ = torch.ops.mmfuse.fp8_quantize(gate_up, gu_w, False, True, False, True, False)
                dx = torch.ops.mmfuse.fp8_gemm(q[:M], gu_qt, q_si, gu_si, None, False, False)[:, :H]
                del gu_qt
            if need_dgu:
                qt = torch.ops.mmfuse.fp8_transpose(q)
                del q
                dgu = torch.ops.mmfuse.fp8_gemm(qt[:two_i], x_qt, q_si, x_si, None, False, False)[:, :H]
        return dx, dgu, ddown if need_ddn else None, None, None, None
