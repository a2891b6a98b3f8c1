"""A scoped, reversible patch of the installed transformers' Qwen2.5-VL (transformers 4.49-4.57 and 5.x)
that trains it with mmfuse:

- ``positions``: the 3-D text position ids -> :func:`mmfuse.rope_index` in the mode of the installed
  release (bit-exact, on the device, no host sync); the vision tower's patch positions, RoPE table and
  window order -> :func:`mmfuse.vision_positions` / :func:`mmfuse.rot_pos_emb` /
  :func:`mmfuse.window_index` (bit-exact);
- ``rope``: the text mRoPE -> :func:`mmfuse.mrope` with ``numerics="hf_eager"`` (bitwise equal to
  transformers' formula, forward and backward); the vision RoPE (fp32 tables) -> ``numerics="fp32"``
  (bitwise equal forward);
- ``rms_norm``: every Qwen2.5-VL RMSNorm (text and vision) -> :func:`mmfuse.rms_norm` (HF's roundings;
  the mean square summed in another order, so close rather than bitwise); where the weight's dtype is
  not the input's, transformers' own;
- ``swiglu``: the text and vision MLPs -> one GEMM against the stacked gate/up weight and
  :func:`mmfuse.swiglu` (fp32 math, one rounding: close to HF's two bf16 roundings), then the down
  projection; an MLP whose activation is not SiLU stays transformers' own;
- ``linear_cross_entropy``: in training with ``labels``, the loss from the final hidden states and
  ``lm_head.weight`` through :func:`mmfuse.linear_cross_entropy`, never holding the ``[B, L, V]``
  logits (``outputs.logits`` is None then; eval and label-free calls are unchanged); transformers'
  causal-LM loss (shifted labels, -100 ignored, ``num_items_in_batch`` from the Trainer);
- ``vision_attention``: the vision tower's window attention with SDPA (transformers 4.52+ calls SDPA
  once a window, 4.49-4.51 once over every patch under a block-diagonal mask) -> one SDPA call for
  each run of consecutive windows of one length (:mod:`mmfuse.integrations.window_attention`; 4.52+:
  the same kernel, batched);
- ``fp8`` (needs ``model``): every ``nn.Linear`` of the model but ``lm_head`` -> :class:`mmfuse.nn.Fp8Linear`
  (same parameters; bf16 where fp8 does not pay), put back on revert.

Usage::

    from mmfuse.integrations.transformers import patch_qwen2_5_vl
    with patch_qwen2_5_vl(model):
        loss = model(**batch, labels=labels).loss     # inside: mmfuse; outside: transformers as installed

or ``patch = patch_qwen2_5_vl(model); patch.apply(); ...; patch.revert()``; with the transformers
``Trainer``: ``Trainer(..., callbacks=[PatchCallback()])`` applies the patch to the trained model for
the run. The patch changes functions and methods of transformers' modules (every model of these classes
is affected while it is active; in 4.49-5.1 the RMSNorm class is Qwen2's own, shared with Qwen2 models).
What it replaces in each transformers layout: :mod:`mmfuse.integrations.qwen_vl`.
:class:`patch_qwen2_vl` does the same for Qwen2-VL, :class:`patch_qwen3_vl` for Qwen3-VL (not its positions).
"""

from typing import Optional

import torch

from . import qwen_vl as _q

_MISSING = object()


class patch_qwen2_5_vl:
    """Scoped patch of Qwen2.5-VL (a context manager, or ``apply()`` / ``revert()``); see the module
    docstring.

    Args:
        model: the model to convert for ``fp8`` (not needed otherwise: the rest patches the classes).
        positions, rope, rms_norm, swiglu, linear_cross_entropy, fp8, vision_attention: which pieces to
            patch.

    A piece the installed transformers lays out in a way mmfuse does not know raises ImportError at
    ``apply()``, naming the piece and the supported versions; pass that piece as False to go on.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, *, positions: bool = True, rope: bool = True,
                 rms_norm: bool = True, swiglu: bool = True, linear_cross_entropy: bool = True, fp8: bool = False,
                 vision_attention: bool = True):
        if fp8 and model is None:
            raise ValueError("patch_qwen2_5_vl: fp8=True converts the model's linears: pass the model")
        self.model = model
        self.positions, self.rope, self.rms_norm, self.swiglu = positions, rope, rms_norm, swiglu
        self.linear_cross_entropy, self.fp8, self.vision_attention = linear_cross_entropy, fp8, vision_attention
        self._resolved = None  # the replacements, made once: re-applying installs the same functions
        self._saved = []    # (owner, attribute, previous value or _MISSING)
        self._swapped = []  # (parent module, child name, the nn.Linear put back on revert)

    spec = _q.QWEN2_5_VL

    def _targets(self):
        spec = self.spec
        m, v = _q.modeling(spec)
        pieces = [(self.positions, _q.text_positions_targets), (self.positions, _q.vision_positions_targets),
                  (self.rope, _q.rope_targets), (self.rms_norm, _q.rms_norm_targets),
                  (self.swiglu, _q.swiglu_targets), (self.linear_cross_entropy, _q.linear_cross_entropy_targets),
                  (self.vision_attention, _q.vision_attention_targets)]
        return [t for on, make in pieces if on for t in make(spec, m, v)]

    def apply(self):
        if self._saved or self._swapped:
            raise RuntimeError("mmfuse patch_qwen2_5_vl: already applied")
        if self._resolved is None:
            self._resolved = self._targets()  # every piece resolved before anything changes
        for owner, name, new in self._resolved:
            self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, new)
        if self.fp8:
            self._convert_fp8()
        return self

    def _convert_fp8(self):
        from ..nn.fp8 import Fp8Linear
        for name, mod in list(self.model.named_modules()):
            for child_name, child in list(mod.named_children()):
                if type(child) is torch.nn.Linear and not (name.endswith("lm_head") or child_name == "lm_head"):
                    self._swapped.append((mod, child_name, child))
                    setattr(mod, child_name, Fp8Linear.from_linear(child))

    def revert(self):
        while self._swapped:
            parent, name, linear = self._swapped.pop()
            setattr(parent, name, linear)
        while self._saved:
            owner, name, value = self._saved.pop()
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    def __enter__(self):
        return self.apply()

    def __exit__(self, *exc):
        self.revert()
        return False


class patch_qwen2_vl(patch_qwen2_5_vl):
    """The same patch for Qwen2-VL (its text decoder, positions, RoPE and loss; its vision tower has no
    windows and a GELU MLP, which stay transformers' own)."""

    spec = _q.QWEN2_VL


class patch_qwen3_vl(patch_qwen2_5_vl):
    """The same patch for Qwen3-VL (transformers 4.57+): its text mRoPE (interleaved tables, as its
    rotary module makes them), vision RoPE, text RMSNorm, SwiGLU MLP and the loss. Its positions
    (timestamps between video frames) stay transformers' own: ``positions`` must be False."""

    spec = _q.QWEN3_VL

    def __init__(self, model: Optional[torch.nn.Module] = None, *, positions: bool = False, **kwargs):
        if positions:
            raise ValueError("patch_qwen3_vl: positions=True: Qwen3-VL's position ids (timestamps between video "
                             "frames) are not covered by mmfuse.rope_index; leave positions=False")
        super().__init__(model, positions=False, **kwargs)


def _trainer_callback_base():
    try:
        from transformers import TrainerCallback
    except ImportError:
        return object
    return TrainerCallback


class PatchCallback(_trainer_callback_base()):
    """A transformers ``TrainerCallback`` that applies :class:`patch_qwen2_5_vl` (or ``patch``, e.g.
    :class:`patch_qwen2_vl`), with these keyword arguments, to the trained model when training begins
    and reverts it when training ends."""

    def __init__(self, patch=None, **patch_kwargs):
        self.patch_cls = patch or patch_qwen2_5_vl
        self.patch_kwargs = patch_kwargs
        self.patch = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.patch = self.patch_cls(model, **self.patch_kwargs).apply()

    def on_train_end(self, args, state, control, **kwargs):
        if self.patch is not None:
            self.patch.revert()
            self.patch = None


__all__ = ["PatchCallback", "patch_qwen2_5_vl", "patch_qwen2_vl", "patch_qwen3_vl"]
