"""``Fp8Linear``: a drop-in ``nn.Linear`` whose forward and backward GEMMs run in fp8 (e4m3 operands,
e5m2 or e4m3 gradients, fp32 accumulation), with its scale state owned by the module."""

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .. import fp8 as _fp8
from .fp32_buffers import Fp32Buffers

Tensor = torch.Tensor


class Fp8Linear(Fp32Buffers, torch.nn.Linear):
    r"""``y = x @ weight^T + bias`` with the GEMMs in fp8 (:func:`mmfuse.fp8.fp8_linear`).

    Same parameters, ``state_dict`` and constructor as ``nn.Linear``, plus:

    Args:
        scaling: ``"delayed"`` (the default with the per-tensor recipe, as in TransformerEngine): x and
            the output gradient scaled by the maximum of their last ``history`` amaxes (one pass each;
            values past that range saturate; a fresh state is exact on its first call); ``"dynamic"``
            (the default with ``recipe="row"``): every tensor scaled by its own amax (exact range, one
            extra read of x and of the gradient, so a little slower). w is always scaled dynamically.
        recipe: ``"tensor"`` (default) or ``"row"`` (a scale a row of every fp8 copy: more accurate;
            needs ``scaling="dynamic"``).
        history: length of the amax history (delayed scaling).
        grad_dtype: ``torch.float8_e5m2`` (default) or ``torch.float8_e4m3fn`` for the output gradient.
        bf16_wgrad: compute dW in bf16 (from the bf16 x, saved instead of its fp8 copy).
        fallback: on the GPU, run shapes where fp8 does not pay (:func:`mmfuse.fp8.fp8_pays`, measured)
            as plain bf16 ``F.linear``. On the CPU the fp8 numerics are emulated (for tests), always.
        fuse_wgrad_accumulation: add dW into ``weight.main_grad`` (an fp32 buffer the caller attaches)
            instead of producing ``weight.grad``.

    ``forward(x, is_first_microbatch=None)``: with gradient accumulation over micro-batches, pass
    True on the first micro-batch of an optimizer step (w is quantized and its fp8 copies kept) and
    False on the others (the copies are reused: w must not change in between). None: w is quantized
    on every call. Parameters that are not bf16 (e.g. fp32 master weights) are cast to bf16 for the
    GEMM, like autocast; the output is bf16.

    The scale states are buffers (not in the ``state_dict``): ``x_state``, ``w_state``, ``g_state``.
    """

    _fp32_suffixes = ("_state",)  # the scaling states stay float32 when the module is cast

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 scaling: Optional[str] = None, recipe: str = "tensor", history: int = _fp8.DEFAULT_HISTORY,
                 grad_dtype: torch.dtype = _fp8.E5M2, bf16_wgrad: bool = False, fallback: bool = True,
                 fuse_wgrad_accumulation: bool = False) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if scaling is None:
            scaling = "dynamic" if recipe == "row" else "delayed"
        if scaling not in ("dynamic", "delayed"):
            raise ValueError(f"Fp8Linear: scaling: expected 'dynamic' or 'delayed', got {scaling!r}")
        if recipe not in ("tensor", "row") or (recipe == "row" and scaling != "dynamic"):
            raise ValueError(f"Fp8Linear: recipe: expected 'tensor', or 'row' with scaling='dynamic', got recipe="
                             f"{recipe!r}, scaling={scaling!r}")
        if grad_dtype not in (_fp8.E4M3, _fp8.E5M2):
            raise ValueError(f"Fp8Linear: grad_dtype: expected torch.float8_e5m2 or torch.float8_e4m3fn, got {grad_dtype}")
        self.scaling = scaling
        self.recipe = recipe
        self.grad_dtype = grad_dtype
        self.bf16_wgrad = bf16_wgrad
        self.fallback = fallback
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        dev = self.weight.device
        self.register_buffer("x_state", _fp8.new_state(history, dev), persistent=False)
        self.register_buffer("w_state", _fp8.new_state(1, dev), persistent=False)
        self.register_buffer("g_state", _fp8.new_state(history, dev), persistent=False)
        self._weight_fp8: Optional[_fp8.Fp8Quantized] = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **kwargs) -> "Fp8Linear":
        """An Fp8Linear that shares ``linear``'s parameters (the same Parameter objects: optimizers that
        hold them keep working)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
                dtype=linear.weight.dtype, **kwargs)
        m.weight = linear.weight
        m.bias = linear.bias
        return m

    def _uses_fp8(self, x: Tensor) -> bool:
        if not x.is_cuda:
            return True
        m = x.numel() // max(1, x.shape[-1])
        return not self.fallback or _fp8.fp8_pays(m, self.out_features, self.in_features)

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        if not x.is_floating_point():
            raise TypeError(f"Fp8Linear: x: expected a floating-point tensor (as nn.Linear), got {x.dtype}")
        if not self._uses_fp8(x):
            return F.linear(x, self.weight, self.bias)
        bf = torch.bfloat16
        w = self.weight if self.weight.dtype == bf else self.weight.to(bf)
        b = None if self.bias is None else (self.bias if self.bias.dtype == bf else self.bias.to(bf))
        main_grad = None
        if self.fuse_wgrad_accumulation:
            main_grad = getattr(self.weight, "main_grad", None)
            if main_grad is None:
                raise ValueError("Fp8Linear: fuse_wgrad_accumulation=True: expected weight.main_grad (an fp32 "
                                 f"[{self.out_features}, {self.in_features}] buffer), found none")
        cached = None
        if is_first_microbatch is False:
            if self._weight_fp8 is None:
                raise ValueError("Fp8Linear: is_first_microbatch=False: no cached fp8 weight (pass True on the "
                                 "first micro-batch of the step)")
            cached = self._weight_fp8
        keep = bool(is_first_microbatch)
        out = _fp8.fp8_linear(x.to(bf), w, b, x_state=self.x_state, w_state=self.w_state, g_state=self.g_state,
                              scaling=self.scaling, weight_fp8=cached, grad_dtype=self.grad_dtype,
                              bf16_wgrad=self.bf16_wgrad, main_grad=main_grad, return_weight_fp8=keep,
                              recipe=self.recipe)
        if keep:
            out, self._weight_fp8 = out
        elif is_first_microbatch is None:
            self._weight_fp8 = None
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling}, recipe={self.recipe}, grad_dtype={self.grad_dtype}"

    def fp8_delayed_states(self) -> List[Tensor]:
        """The amax states that delayed scaling reads (x's and the gradient's; w is scaled dynamically)."""
        return [self.x_state, self.g_state] if self.scaling == "delayed" else []


def reduce_amax_histories(model: torch.nn.Module, group=None) -> int:
    """Makes every rank's delayed-scaling amax histories the element-wise maximum over the ranks of
    ``group`` (the default process group when None), in one all-reduce, so that every rank quantizes
    its next call with the same scales. Call it on every rank after each step's backward (the
    histories move in step on all ranks). The scratch words of a state are zero between calls, so
    reducing them too changes nothing. Returns the number of states reduced (0 without a process
    group)."""
    import torch.distributed as dist

    states = [s for m in model.modules() if hasattr(m, "fp8_delayed_states") for s in m.fp8_delayed_states()]
    if not states or not dist.is_available() or not dist.is_initialized():
        return 0
    flat = torch.cat([s.reshape(-1) for s in states])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for s in states:
        s.copy_(flat[offset:offset + s.numel()].view_as(s))
        offset += s.numel()
    return len(states)


# convert_to_fp8's options the two-expert modules take, and Fp8Linear's others at the values that
# are the experts' behaviour too (any other value is refused for the experts)
_EXPERT_OPTIONS = ("scaling", "history", "grad_dtype")
_LINEAR_ONLY_DEFAULTS = dict(recipe="tensor", bf16_wgrad=False, fallback=True, fuse_wgrad_accumulation=False)


def convert_to_fp8(model: torch.nn.Module, filter_fn: Optional[Callable[[str, torch.nn.Module], bool]] = None,
                   **kwargs) -> torch.nn.Module:
    """Replaces, in place, every ``nn.Linear`` of ``model`` (its fully qualified name and the module
    passed to ``filter_fn``, all of them when None) by an :class:`Fp8Linear` sharing its parameters, and
    turns on the fp8 path of every two-expert module (:class:`mmfuse.nn.DualExpertMLP`,
    :class:`mmfuse.nn.vla.MoTExperts`: each expert in fp8 where it pays) that ``filter_fn`` selects.
    ``kwargs`` go to Fp8Linear; the experts take ``scaling`` (``None``: delayed), ``history`` and
    ``grad_dtype``, and refuse the options they do not have (a ``recipe`` other than ``"tensor"``,
    ``bf16_wgrad``, ``fallback=False``, ``fuse_wgrad_accumulation``). Returns ``model``. A bare ``nn.Linear`` cannot be replaced in
    place: it is an error (use :meth:`Fp8Linear.from_linear`)."""
    from .fp8_experts import Fp8Experts

    if type(model) is torch.nn.Linear:
        raise ValueError("convert_to_fp8: model is an nn.Linear itself, which cannot be replaced in place: use "
                         "Fp8Linear.from_linear(model) (or pass the module that holds it)")
    experts = [(name, m) for name, m in model.named_modules()
               if isinstance(m, Fp8Experts) and (filter_fn is None or filter_fn(name, m))]
    if experts:
        unsupported = {k: v for k, v in kwargs.items()
                       if k not in _EXPERT_OPTIONS and (k not in _LINEAR_ONLY_DEFAULTS or v != _LINEAR_ONLY_DEFAULTS[k])}
        if unsupported:
            raise ValueError(f"convert_to_fp8: {', '.join(f'{k}={v!r}' for k, v in unsupported.items())}: not an "
                             f"option of the fp8 experts ({experts[0][0] or 'model'}: per-tensor scaling, fp8 where "
                             "it pays); leave them out with filter_fn")
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is torch.nn.Linear and (filter_fn is None or filter_fn(full, child)):
                setattr(mod, child_name, Fp8Linear.from_linear(child, **kwargs))
    opts = {k: v for k, v in kwargs.items() if k in _EXPERT_OPTIONS and v is not None}
    for _, m in experts:
        m.enable_fp8(**opts)
    return model
