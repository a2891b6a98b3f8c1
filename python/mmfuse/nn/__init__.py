"""Modules built on mmfuse's ops."""

from .dual_gemm import DualExpertMLP
from .fp8 import Fp8Linear, convert_to_fp8, reduce_amax_histories
from . import vla  # noqa: F401  (mmfuse.nn.vla: the VLA decoder stack)

__all__ = ["DualExpertMLP", "Fp8Linear", "convert_to_fp8", "reduce_amax_histories"]
