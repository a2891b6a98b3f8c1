"""A VLA mixture-of-transformers decoder stack built on mmfuse: the layer chain fused and the tokens of
the two experts grouped for free.

Per layer: ``rms_norm`` adds the previous expert block's output to the residual stream and normalizes
in one pass; q, k and v are one GEMM; mRoPE is computed from the 3-D positions (no cos/sin tables),
in place on that GEMM's output;
attention is SDPA; the second ``rms_norm`` writes its output *grouped* (every sample's vision-language
tokens, then every action token), so the two SwiGLU experts (:class:`MoTExperts`: gate/up one dual
GEMM, SwiGLU, down one dual GEMM) read and write two contiguous blocks with no copy, and the next
layer's ``rms_norm`` reads that grouped output back into token order. The expert block saves its input
and the gate/up output only; the SwiGLU output is recomputed in the backward, in place: the saved
gate/up output becomes its own gradient (eager; a second backward through the same graph is refused).
An fp8 expert saves its gate/up output packed in fp8 instead (``swiglu_pack_fp8``).

Weights load from the reference model of ``mmfuse-bench train`` (:meth:`VLADecoder.load_reference`).
"""

from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import fp8 as _fp8
from ..rms_norm import rms_norm
from ..swiglu import swiglu, swiglu_backward, swiglu_backward_
from .fp32_buffers import Fp32Buffers
from .fp8 import Fp8Linear
from .fp8_experts import Fp8Experts


class _MoTExpertsFn(torch.autograd.Function):
    """x [T, H] grouped (the first m0 rows expert 0's) -> y [T, H] grouped; SwiGLU experts without bias."""

    @staticmethod
    def forward(ctx, x, m0, gate_up0, down0, gate_up1, down1):
        x0, x1 = x[:m0], x[m0:]
        g0, g1 = torch.ops.mmfuse.dual_gemm(x0, gate_up0, x1, gate_up1, False, True, False)
        y = x.new_empty(x.shape)
        torch.ops.mmfuse.dual_gemm_out(swiglu(g0), down0, swiglu(g1), down1, y[:m0], y[m0:], False, True, False)
        ctx.save_for_backward(x, g0, g1, gate_up0, down0, gate_up1, down1)
        ctx.m0 = m0
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g0, g1, gate_up0, down0, gate_up1, down1 = ctx.saved_tensors
        m0 = ctx.m0
        dy = dy.contiguous()
        dy0, dy1 = dy[:m0], dy[m0:]
        x0, x1 = x[:m0], x[m0:]
        da0, da1 = torch.ops.mmfuse.dual_gemm(dy0, down0, dy1, down1, False, False, False)
        if torch.compiler.is_compiling():  # traced: the functional op (a graph would copy the mutation back)
            (dg0, a0), (dg1, a1) = swiglu_backward(da0, g0, True), swiglu_backward(da1, g1, True)
        else:  # in place: the saved gate/up outputs become their gradients and da the activations
            swiglu_backward_(da0, g0)
            swiglu_backward_(da1, g1)
            (dg0, a0), (dg1, a1) = (g0, da0), (g1, da1)
        del da0, da1, g0, g1
        ddown0, ddown1 = torch.ops.mmfuse.dual_gemm(dy0, a0, dy1, a1, True, False, False)
        del a0, a1
        dx = torch.empty_like(x)
        torch.ops.mmfuse.dual_gemm_out(dg0, gate_up0, dg1, gate_up1, dx[:m0], dx[m0:], False, False, False)
        dgu0, dgu1 = torch.ops.mmfuse.dual_gemm(dg0, x0, dg1, x1, True, False, False)
        return dx, None, dgu0, ddown0, dgu1, ddown1


class _RotateQKFn(torch.autograd.Function):
    """mRoPE from the positions on the q and k heads of the fused q/k/v GEMM output
    ``[B * L, (heads + 2 kv) D]``, in place: the attention then saves views of that one buffer, not
    rotated copies of q and k next to it. In place on the GEMM's own output, not on a view of it: a view
    marked dirty makes autograd copy the whole gradient three times in the backward (CopySlices). The
    backward writes the adjoint rotation into a new gradient (the incoming one is not ours)."""

    @staticmethod
    def forward(ctx, qkv, positions, inv_freq, section, heads, kv_heads, B, L):
        x = qkv.view(B, L, heads + 2 * kv_heads, -1)
        q, k = x[:, :, :heads], x[:, :, heads:heads + kv_heads]
        torch.ops.mmfuse.mrope_(q, k, None, None, positions, inv_freq, section, False, "fp32", False, False)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(positions, inv_freq)
        ctx.meta = (section, heads, kv_heads, B, L)
        return qkv

    @staticmethod
    def backward(ctx, g):
        positions, inv_freq = ctx.saved_tensors
        section, heads, kv, B, L = ctx.meta
        g = g.reshape(B, L, heads + 2 * kv, -1)  # the incoming gradient may have any strides
        if torch.compiler.is_compiling():
            # traced: in place on g, which is then the graph's own buffer (SDPA's gradients concatenated),
            # rotated where it lies; out of place, the v part's copy became a whole-tensor slice_scatter
            torch.ops.mmfuse.mrope_(g[:, :, :heads], g[:, :, heads:heads + kv], None, None, positions, inv_freq,
                                    section, False, "fp32", True, False)
            return g.view(B * L, -1), None, None, None, None, None, None, None
        d = torch.empty_like(g)
        torch.ops.mmfuse.mrope_out(g[:, :, :heads], g[:, :, heads:heads + kv], None, None, positions, inv_freq,
                                   section, False, "fp32", True, False, d[:, :, :heads], d[:, :, heads:heads + kv])
        d[:, :, heads + kv:] = g[:, :, heads + kv:]
        return d.view(B * L, -1), None, None, None, None, None, None, None


class MoTExperts(Fp8Experts, nn.Module):
    """Two SwiGLU experts over one grouped token block: rows ``[0, m0)`` go through expert 0 (hidden ->
    inter0 -> hidden), the rest through expert 1. Weights in ``nn.Linear`` layout, gate and up stacked:
    ``gate_up_e [2 * inter_e, hidden]`` = ``[gate_e; up_e]``, ``down_e [hidden, inter_e]``.

    With ``fp8=True`` (or :meth:`enable_fp8`, which :func:`mmfuse.nn.convert_to_fp8` calls) an expert whose
    gate/up GEMM is big enough for fp8 to pay (:func:`mmfuse.fp8.fp8_pays`; always on the CPU, which
    emulates fp8) runs both its projections through :func:`mmfuse.fp8_linear` (e4m3 operands, e5m2
    gradients or ``grad_dtype``, delayed or dynamic ``scaling``, fp8 copies saved for the backward, the
    gate/up output saved packed in fp8: :func:`mmfuse.swiglu.swiglu_pack_fp8`); the other stays bf16. The
    states are buffers (``fp8_delayed_states`` lists the delayed ones for
    :func:`mmfuse.nn.reduce_amax_histories`)."""

    def __init__(self, hidden: int, intermediate_sizes: Sequence[int], *, fp8: bool = False,
                 history: int = _fp8.DEFAULT_HISTORY, grad_dtype: torch.dtype = _fp8.E5M2, scaling: str = "delayed",
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        i0, i1 = intermediate_sizes
        self.gate_up0 = nn.Parameter(torch.empty(2 * i0, hidden, **kw))
        self.down0 = nn.Parameter(torch.empty(hidden, i0, **kw))
        self.gate_up1 = nn.Parameter(torch.empty(2 * i1, hidden, **kw))
        self.down1 = nn.Parameter(torch.empty(hidden, i1, **kw))
        self._init_fp8(fp8, history, grad_dtype, scaling)

    def forward(self, x: Tensor, m0: int) -> Tensor:
        if x.dim() != 2 or not 0 <= m0 <= x.shape[0]:
            raise ValueError(f"MoTExperts: expected x [T, H] and 0 <= m0 <= T, got {tuple(x.shape)} and m0 = {m0}")
        m0 = int(m0)
        fp8 = [self._uses_fp8(x, m0, 0), self._uses_fp8(x, x.shape[0] - m0, 1)]
        if not any(fp8):
            return _MoTExpertsFn.apply(x, m0, self.gate_up0, self.down0, self.gate_up1, self.down1)
        outs = []
        # split, not two slices: their backward would be two zero-filled [T, H] gradients added up
        for e, part in enumerate(x.split([m0, x.shape[0] - m0])):
            if fp8[e]:
                outs.append(self._fp8_expert(part, e))
            else:  # saved for backward as a copy beside an fp8 expert: a view would keep the whole of x alive
                outs.append(self._plain_expert(part.clone() if fp8[1 - e] else part, e))
        return torch.cat(outs)


class VLADecoderLayer(nn.Module):
    def __init__(self, cfg, *, fp8: bool = False, fp8_grad_dtype: torch.dtype = _fp8.E5M2, fp8_scaling: str = "delayed",
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.cfg = cfg
        d = cfg.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * d, bias=True, **kw)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False, **kw)
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.experts = MoTExperts(cfg.hidden, (cfg.inter_vl, cfg.inter_action), fp8=fp8, grad_dtype=fp8_grad_dtype,
                                  scaling=fp8_scaling, **kw)
        if fp8:  # the projections through Fp8Linear (bf16 where fp8 does not pay)
            self.qkv = Fp8Linear.from_linear(self.qkv, grad_dtype=fp8_grad_dtype, scaling=fp8_scaling)
            self.o_proj = Fp8Linear.from_linear(self.o_proj, grad_dtype=fp8_grad_dtype, scaling=fp8_scaling)

    def forward(self, y: Tensor, residual: Optional[Tensor], positions: Tensor, inv_freq: Tensor, B: int, L: int,
                split: int):
        """y: the previous expert block's output (grouped), or the embeddings (token order) where
        residual is None. Returns (this expert block's output, grouped; the residual stream)."""
        cfg = self.cfg
        grouping = (L, split)
        if residual is None:
            normed, h = rms_norm(y, self.input_layernorm, cfg.eps), y
        else:
            normed, h = rms_norm(y, self.input_layernorm, cfg.eps, residual, grouping=grouping, x_grouped=True)
        d = cfg.head_dim
        qkv = _RotateQKFn.apply(self.qkv(normed), positions, inv_freq, list(cfg.mrope_section), cfg.heads,
                                cfg.kv_heads, B, L).view(B, L, cfg.heads + 2 * cfg.kv_heads, d)
        q, k, v = qkv.split([cfg.heads, cfg.kv_heads, cfg.kv_heads], dim=2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        o = self.o_proj(a.transpose(1, 2).reshape(B * L, cfg.heads * d))
        normed, h = rms_norm(o, self.post_attention_layernorm, cfg.eps, h, grouping=grouping, out_grouped=True)
        return self.experts(normed, B * split), h


class VLADecoder(Fp32Buffers, nn.Module):
    """The decoder stack on mmfuse; forward(embeds [B, L, hidden], positions [3, B, L], action) ->
    [B, L, hidden], the last ``action`` tokens of each sample going through the action expert.
    ``fp8=True``: the q/k/v and o projections and the experts in fp8 where it pays (delayed scaling;
    under data parallelism call :func:`mmfuse.nn.reduce_amax_histories` after each backward);
    ``fp8_grad_dtype``: the output gradients' fp8 format (e5m2 by default, or e4m3: finer, less range);
    ``fp8_scaling``: ``"delayed"`` (default: the scale from the amax history, one pass a tensor) or
    ``"dynamic"`` (each tensor's own amax, one more read of it)."""

    _fp32_suffixes = ("inv_freq",)  # rotary frequencies stay float32 (angles never in low precision)

    def __init__(self, cfg, *, fp8: bool = False, fp8_grad_dtype: torch.dtype = _fp8.E5M2, fp8_scaling: str = "delayed",
                 device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv.to(device), persistent=False)
        self.layers = nn.ModuleList(VLADecoderLayer(cfg, fp8=fp8, fp8_grad_dtype=fp8_grad_dtype,
                                                    fp8_scaling=fp8_scaling, device=device, dtype=dtype)
                                    for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden, device=device, dtype=dtype))

    def forward(self, embeds: Tensor, positions: Tensor, action: int) -> Tensor:
        B, L, H = embeds.shape
        split = L - int(action)
        y, residual = embeds.reshape(B * L, H), None
        for layer in self.layers:
            y, residual = layer(y, residual, positions, self.inv_freq, B, L, split)
        out, _ = rms_norm(y, self.norm, self.cfg.eps, residual, grouping=(L, split), x_grouped=True)
        return out.view(B, L, H)

    @torch.no_grad()
    def load_reference(self, state: Dict[str, Tensor]) -> None:
        """Copies the weights of the reference model (``mmfuse.bench.vla_reference.VLAReference``'s
        state dict): q/k/v stacked into qkv, gate and up into gate_up."""
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            layer.input_layernorm.copy_(state[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.copy_(state[p + "post_attention_layernorm.weight"])
            a = p + "self_attn."
            layer.qkv.weight.copy_(torch.cat([state[a + n + "_proj.weight"] for n in "qkv"]))
            layer.qkv.bias.copy_(torch.cat([state[a + n + "_proj.bias"] for n in "qkv"]))
            layer.o_proj.weight.copy_(state[a + "o_proj.weight"])
            for e, name in ((0, "vl"), (1, "action")):
                m = f"{p}mlp.{name}."
                getattr(layer.experts, f"gate_up{e}").copy_(
                    torch.cat([state[m + "gate_proj.weight"], state[m + "up_proj.weight"]]))
                getattr(layer.experts, f"down{e}").copy_(state[m + "down_proj.weight"])
        self.norm.copy_(state["norm.weight"])

    def reference_grads(self) -> Dict[str, Tensor]:
        """The gradients under the reference model's parameter names (for comparing the two models)."""
        out = {}
        c = self.cfg
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm.grad
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.grad
            sizes = [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim]
            for n, w, b in zip("qkv", layer.qkv.weight.grad.split(sizes), layer.qkv.bias.grad.split(sizes)):
                out[p + f"self_attn.{n}_proj.weight"] = w
                out[p + f"self_attn.{n}_proj.bias"] = b
            out[p + "self_attn.o_proj.weight"] = layer.o_proj.weight.grad
            for e, name, inter in ((0, "vl", c.inter_vl), (1, "action", c.inter_action)):
                gu = getattr(layer.experts, f"gate_up{e}").grad
                out[p + f"mlp.{name}.gate_proj.weight"] = gu[:inter]
                out[p + f"mlp.{name}.up_proj.weight"] = gu[inter:]
                out[p + f"mlp.{name}.down_proj.weight"] = getattr(layer.experts, f"down{e}").grad
        out["norm.weight"] = self.norm.grad
        return out
