"""The training loss of a transformers causal LM through :func:`mmfuse.linear_cross_entropy`: a wrapper of
a ``*ForCausalLM`` / ``*ForConditionalGeneration`` ``forward`` that never materializes the logits.

In training (``model.training``) with ``labels``, the wrapped forward runs the model's own forward with
``labels=None`` and its ``lm_head`` read as the identity (so the "logits" it returns are the final hidden
states: no ``[B, L, V]`` tensor is made), then computes transformers' causal-LM loss from those hidden
states and ``lm_head.weight``: labels shifted left by one (or ``shift_labels`` when given), ``-100``
ignored, the mean over the tokens not ignored, or the sum divided by ``num_items_in_batch`` when the
Trainer passes it (gradient accumulation). The output's ``loss`` is that loss and its ``logits`` is
None. In eval mode, or without labels, the model's own forward runs unchanged (logits as usual).

Any forward whose logits are ``lm_head(hidden_states[...])`` and whose loss is transformers'
``ForCausalLMLoss`` fits; what is bound is found from the forward's signature, so one wrapper serves
every transformers version.
"""

import functools
import inspect

import torch

from ..linear_cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100


class _Identity(torch.nn.Module):
    """Stands in for ``lm_head`` while the wrapped forward runs: returns the hidden states."""

    def forward(self, x):
        return x


_IDENTITY = _Identity()


def causal_lm_loss(hidden, weight, labels, *, shift_labels=None, num_items_in_batch=None, bias=None,
                   chunk_tokens: int = 1024):
    """transformers' ``ForCausalLMLoss`` of ``hidden @ weight^T`` (+ bias), without the logits.

    hidden ``[B, L, H]``; labels ``[B, L]`` (shifted here: token ``t`` predicts label ``t + 1``, the last
    position none) or ``shift_labels`` ``[B, L]`` already shifted. ``num_items_in_batch``: the sum is
    divided by it (an int or a tensor) instead of taking the mean.
    """
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(h, weight, y, bias, ignore_index=IGNORE_INDEX, reduction="mean",
                                    chunk_tokens=chunk_tokens)
    loss = linear_cross_entropy(h, weight, y, bias, ignore_index=IGNORE_INDEX, reduction="sum",
                                chunk_tokens=chunk_tokens)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def wrap_forward(orig):
    """``orig`` (a model class's ``forward``) with the training loss through :func:`causal_lm_loss`; see
    the module docstring. The wrapper keeps ``orig``'s signature (``inspect.signature`` follows it), which
    the Trainer reads to decide whether to pass ``num_items_in_batch``."""
    sig = inspect.signature(orig)
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    if "labels" not in sig.parameters:
        raise TypeError(f"mmfuse causal_lm_loss: {orig.__qualname__} takes no `labels`: not a causal-LM forward")

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None or not self.training or "lm_head" in self.__dict__:
            return orig(self, *args, **kwargs)
        bound.arguments["labels"] = None
        if "logits_to_keep" in bound.arguments:
            bound.arguments["logits_to_keep"] = 0  # the loss needs every position's hidden state
        extra = bound.arguments.get(var_kw, {}) if var_kw else {}
        if bound.arguments.get("return_dict") is False:
            raise ValueError("mmfuse linear_cross_entropy patch: return_dict=False is not supported in training with "
                             "labels (the loss is set on the output object)")
        self.__dict__["lm_head"] = _IDENTITY  # shadows the submodule for this call only
        try:
            out = orig(*bound.args, **bound.kwargs)
        finally:
            del self.__dict__["lm_head"]
        hidden, head = out.logits, self.lm_head
        weight, bias = head.weight, getattr(head, "bias", None)
        dev = hidden.device.type
        if torch.is_autocast_enabled(dev):  # what autocast's lm_head would compute in: its dtype
            dt = torch.get_autocast_dtype(dev)
            hidden, weight = hidden.to(dt), weight.to(dt)
            bias = None if bias is None else bias.to(dt)
        elif hidden.dtype != weight.dtype:
            raise TypeError(f"mmfuse linear_cross_entropy patch: the final hidden states are {hidden.dtype} and "
                            f"lm_head.weight {weight.dtype}: expected one dtype (or autocast)")
        with torch.autocast(dev, enabled=False):
            loss = causal_lm_loss(hidden, weight, labels, shift_labels=extra.get("shift_labels"),
                                  num_items_in_batch=extra.get("num_items_in_batch"), bias=bias)
        # a new output with the loss first and no logits (setting a field that was None on a transformers
        # ModelOutput does not make it a key in every release)
        return type(out)(**{**{k: out[k] for k in out.keys()}, "loss": loss, "logits": None})

    return forward


__all__ = ["causal_lm_loss", "wrap_forward"]
