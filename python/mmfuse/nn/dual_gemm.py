"""``DualExpertMLP``: the two SwiGLU experts of a VLA layer (a large vision-language expert and a small
action expert, of different widths) computed side by side with :func:`mmfuse.dual_gemm`."""

import math
from typing import Optional, Sequence, Tuple

import torch

from .. import fp8 as _fp8
from ..dual_gemm import dual_gemm
from ..moe import moe_permute, moe_unpermute
from ..swiglu import swiglu
from .fp8_experts import Fp8Experts

Tensor = torch.Tensor


class DualExpertMLP(Fp8Experts, torch.nn.Module):
    r"""Two SwiGLU experts of different hidden and intermediate sizes in one module.

    Expert ``e`` (0: the vision-language expert, 1: the action expert) computes, without bias::

        y = down_e(silu(gate_e(x)) * up_e(x))      # hidden_e -> intermediate_e -> hidden_e

    The gate and up projections of both experts are one :func:`mmfuse.dual_gemm` call (their weights
    are stacked, ``gate_up_e = [gate_e; up_e]`` of shape ``[2 * intermediate_e, hidden_e]``), the down
    projections another; the backward is the dual GEMM's backward (dX and dW of both experts, each a
    dual GEMM). The SwiGLU is :func:`mmfuse.swiglu` on the fused ``[gate | up]`` output (fp32 math, one
    rounding; its backward writes the gate/up gradient in one pass, no zero-filled slices).

    Args:
        hidden_sizes: ``(hidden_0, hidden_1)``, e.g. ``(2048, 1024)``.
        intermediate_sizes: ``(intermediate_0, intermediate_1)``, e.g. ``(11008, 2048)``.
        device, dtype: of the parameters (bf16 or fp16 for the fast path; fp32 / fp64 work too).
        fp8: each expert whose gate/up GEMM is big enough for fp8 to pay (:func:`mmfuse.fp8.fp8_pays`, the
            rule of :class:`mmfuse.nn.Fp8Linear`; always on the CPU, which emulates fp8) runs in fp8: e4m3
            operands, ``grad_dtype`` gradients, ``scaling`` ``"delayed"`` (``history`` amaxes) or
            ``"dynamic"``, its SwiGLU activation quantized from the gate/up output and that output saved
            packed in fp8; the other expert stays in the parameters' dtype. :meth:`enable_fp8` (what
            :func:`mmfuse.nn.convert_to_fp8` calls) turns it on later.

    Parameters ``gate_up0``, ``down0``, ``gate_up1``, ``down1`` are in ``nn.Linear``'s ``[out, in]``
    layout, initialised like ``nn.Linear``.

    Two ways to call it:

    - :meth:`forward_experts` ``(x0, x1)``: the experts' token streams given separately (any widths).
    - :meth:`forward` ``(x, token_type, num_tokens0=None)``: one mixed sequence ``x [T, H]`` (both experts of
      width H) with ``token_type [T]`` in {0, 1}: the tokens are grouped by type with the top-1 routing of
      :func:`mmfuse.moe_permute` (the two-expert fast path), run through their expert and put back in
      order with :func:`mmfuse.moe_unpermute`.
    """

    def __init__(self, hidden_sizes: Sequence[int], intermediate_sizes: Sequence[int], *, device=None,
                 dtype=None, fp8: bool = False, history: int = _fp8.DEFAULT_HISTORY,
                 grad_dtype: torch.dtype = _fp8.E5M2, scaling: str = "delayed") -> None:
        super().__init__()
        if len(hidden_sizes) != 2 or len(intermediate_sizes) != 2:
            raise ValueError("DualExpertMLP: hidden_sizes and intermediate_sizes: expected two sizes each (one an "
                             f"expert), got {tuple(hidden_sizes)} and {tuple(intermediate_sizes)}")
        for name, sizes in (("hidden_sizes", hidden_sizes), ("intermediate_sizes", intermediate_sizes)):
            if any(int(s) <= 0 for s in sizes):
                raise ValueError(f"DualExpertMLP: {name}: expected positive sizes, got {tuple(sizes)}")
        self.hidden_sizes = tuple(int(h) for h in hidden_sizes)
        self.intermediate_sizes = tuple(int(i) for i in intermediate_sizes)
        kw = dict(device=device, dtype=dtype)
        (h0, h1), (i0, i1) = self.hidden_sizes, self.intermediate_sizes
        self.gate_up0 = torch.nn.Parameter(torch.empty(2 * i0, h0, **kw))
        self.down0 = torch.nn.Parameter(torch.empty(h0, i0, **kw))
        self.gate_up1 = torch.nn.Parameter(torch.empty(2 * i1, h1, **kw))
        self.down1 = torch.nn.Parameter(torch.empty(h1, i1, **kw))
        self.reset_parameters()
        self._init_fp8(fp8, history, grad_dtype, scaling)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: uniform in ``+-1/sqrt(fan_in)``."""
        with torch.no_grad():
            for w in (self.gate_up0, self.down0, self.gate_up1, self.down1):
                bound = 1.0 / math.sqrt(w.shape[1])
                w.uniform_(-bound, bound)

    @classmethod
    def from_mlps(cls, mlp0: torch.nn.Module, mlp1: torch.nn.Module) -> "DualExpertMLP":
        """Builds the module from two HF-style SwiGLU MLPs (``gate_proj``, ``up_proj``, ``down_proj``
        linears without bias, SiLU activation), copying their weights."""
        for name, m in (("mlp0", mlp0), ("mlp1", mlp1)):
            for p in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(m, p, None)
                if not isinstance(lin, torch.nn.Linear) or lin.bias is not None:
                    raise ValueError(f"DualExpertMLP.from_mlps: {name}.{p}: expected an nn.Linear without bias, "
                                     f"got {type(lin).__name__ if lin is not None else None}"
                                     + (" with a bias" if isinstance(lin, torch.nn.Linear) else ""))
        w = mlp0.gate_proj.weight
        out = cls((mlp0.gate_proj.in_features, mlp1.gate_proj.in_features),
                  (mlp0.gate_proj.out_features, mlp1.gate_proj.out_features), device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for e, m in enumerate((mlp0, mlp1)):
                getattr(out, f"gate_up{e}").copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
                getattr(out, f"down{e}").copy_(m.down_proj.weight)
        return out

    def extra_repr(self) -> str:
        return f"hidden_sizes={self.hidden_sizes}, intermediate_sizes={self.intermediate_sizes}"

    def _check(self, x: Tensor, e: int, name: str) -> None:
        h = self.hidden_sizes[e]
        if x.shape[-1] != h:
            raise ValueError(f"DualExpertMLP: {name}: expected last dim {h} (hidden_sizes[{e}]), got shape "
                             f"{tuple(x.shape)}")
        w = self.gate_up0
        if x.dtype != w.dtype or x.device != w.device:
            raise ValueError(f"DualExpertMLP: {name}: expected dtype {w.dtype} on {w.device} (the parameters'), got "
                             f"{x.dtype} on {x.device}")

    def forward_experts(self, x0: Tensor, x1: Tensor) -> Tuple[Tensor, Tensor]:
        """``(expert0(x0), expert1(x1))`` for ``x0 [..., hidden_0]`` and ``x1 [..., hidden_1]`` (either may
        have no tokens); outputs of the inputs' shapes."""
        self._check(x0, 0, "x0")
        self._check(x1, 1, "x1")
        a0, a1 = x0.reshape(-1, x0.shape[-1]), x1.reshape(-1, x1.shape[-1])
        fp8 = [self._uses_fp8(a0, a0.shape[0], 0), self._uses_fp8(a1, a1.shape[0], 1)]
        if any(fp8):  # each expert on its own: fp8 where it pays, the other as below
            y0, y1 = (self._fp8_expert(a.contiguous(), e) if fp8[e] else self._plain_expert(a, e)
                      for e, a in enumerate((a0, a1)))
            return y0.view(x0.shape), y1.view(x1.shape)
        gu0, gu1 = dual_gemm(a0, self.gate_up0, a1, self.gate_up1, trans_b=True)
        s0, s1 = swiglu(gu0), swiglu(gu1)
        y0, y1 = dual_gemm(s0, self.down0, s1, self.down1, trans_b=True)
        return y0.view(x0.shape), y1.view(x1.shape)

    def forward(self, x: Tensor, token_type: Tensor, num_tokens0: Optional[int] = None) -> Tensor:
        """Runs a mixed sequence through the experts by token type.

        Args:
            x: ``[T, H]`` (or ``[..., H]``), ``H = hidden_0 = hidden_1``.
            token_type: ``[T]`` (or x's leading shape), int32 / int64, 0 (vision-language) or 1 (action),
                or bool (True: action). Any other value is an error (raised by :func:`mmfuse.moe_permute`).
            num_tokens0: the number of type-0 tokens when the caller knows it (a VLA's prefix length):
                no host sync, checked on the device (``torch._assert_async``). None: read from the
                routing counts, one device-to-host sync.

        Returns:
            ``[T, H]`` (x's shape): token ``t``'s output of expert ``token_type[t]``.
        """
        if self.hidden_sizes[0] != self.hidden_sizes[1]:
            raise ValueError(f"DualExpertMLP.forward: a mixed sequence needs one width, got hidden_sizes "
                             f"{self.hidden_sizes}; call forward_experts(x0, x1) with the two streams")
        self._check(x, 0, "x")
        if token_type.shape != x.shape[:-1]:
            raise ValueError(f"DualExpertMLP.forward: token_type: expected shape {tuple(x.shape[:-1])} (x's "
                             f"leading dims), got {tuple(token_type.shape)}")
        if token_type.dtype == torch.bool:  # an "is action" mask
            token_type = token_type.to(torch.int32)
        elif token_type.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"DualExpertMLP.forward: token_type: expected int32, int64 or bool, got {token_type.dtype}")
        flat = x.reshape(-1, x.shape[-1])
        p = moe_permute(flat, token_type.reshape(-1, 1), 2)
        if num_tokens0 is None:
            m0 = int(p.counts[0])
        else:
            m0 = int(num_tokens0)
            if not 0 <= m0 <= flat.shape[0]:
                raise ValueError(f"DualExpertMLP.forward: num_tokens0: expected a count in [0, {flat.shape[0]}], "
                                 f"got {num_tokens0}")
            torch._assert_async(p.counts[0] == m0, "DualExpertMLP.forward: num_tokens0 differs from the number of "
                                "type-0 tokens in token_type")
        # split, not two slices: their backward would be two zero-filled [T, H] gradients added up
        y0, y1 = self.forward_experts(*p.rows.split([m0, p.rows.shape[0] - m0]))
        return moe_unpermute(torch.cat([y0, y1]), p.row_id_map).view(x.shape)
