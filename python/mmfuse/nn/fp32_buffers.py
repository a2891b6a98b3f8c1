"""Buffers that stay float32 when their module is cast (``.to(torch.bfloat16)``, ``.half()``,
``.double()``): the fp8 scaling states (amax histories and scales) and the rotary ``inv_freq``, which
the ops read in float32 only. A cast moves them to the new device and keeps their values and dtype."""

import torch


class Fp32Buffers:
    """Mixin for an ``nn.Module`` (before it in the bases): its buffers whose names end in one of
    ``_fp32_suffixes`` keep float32 through every ``Module._apply`` (``to``, ``cuda``, ``half``, ...)."""

    _fp32_suffixes: tuple = ()

    def _apply(self, fn, recurse=True):
        kept = {n: b for n, b in self._buffers.items()
                if b is not None and b.dtype == torch.float32 and n.endswith(self._fp32_suffixes)}
        out = super()._apply(fn, recurse)
        for n, old in kept.items():
            new = self._buffers[n]
            if new is not None and new.dtype != torch.float32:
                self._buffers[n] = old.to(device=new.device)  # moved, not cast: the values as they were
        return out


__all__ = ["Fp32Buffers"]
