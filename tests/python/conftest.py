import os
import sys

# Run against the source tree's python/ when mmfuse is not installed (tools/gpu-check sets
# MMFUSE_LIBRARY to the built _C.so).
_here = os.path.dirname(os.path.abspath(__file__))
_src = os.path.join(_here, "..", "..", "python")
try:
    import mmfuse  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.abspath(_src))


import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _OpRecorder(TorchDispatchMode):
    """Records (aten op name, numel of its first tensor argument or result) for every op run inside."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = next((a for a in list(args) + [out] if isinstance(a, torch.Tensor)), None)
        self.ops.append((str(func.overloadpacket).split(".")[-1], first.numel() if first is not None else 0))
        return out

    def fills_of(self, numel):
        """The zero-fills (zeros, zeros_like, new_zeros, fill_, zero_) of tensors of at least numel elements."""
        return [(n, k) for n, k in self.ops if n in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_") and
                k >= numel]


@pytest.fixture
def record_ops():
    """``with record_ops() as rec: ...``, then ``rec.ops`` / ``rec.fills_of(n)``."""
    return _OpRecorder
