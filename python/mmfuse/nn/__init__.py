"""Modules built on mmfuse's ops."""

from .dual_gemm import DualExpertMLP
from .fp8 import Fp8Linear, convert_to_fp8

__all__ = ["DualExpertMLP", "Fp8Linear", "convert_to_fp8"]
