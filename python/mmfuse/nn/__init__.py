"""Modules built on mmfuse's ops."""

from .dual_gemm import DualExpertMLP

__all__ = ["DualExpertMLP"]
