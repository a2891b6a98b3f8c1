"""mmfuse: fused operators for training multimodal (vision-language-action) transformers.

Every op is a registered PyTorch operator (``torch.ops.mmfuse.*``) with CPU and CUDA kernels, a fake
(meta) implementation for ``torch.compile`` and, where differentiable, autograd.
"""

from . import _lib  # noqa: F401  (registers torch.ops.mmfuse)
from .dual_gemm import dual_gemm, dual_gemm_out
from . import fp8  # noqa: F401  (mmfuse.fp8.*)
from .fp8 import fp8_gemm, fp8_linear, fp8_quantize
from .linear_cross_entropy import linear_cross_entropy
from .moe import Permuted, moe_permute, moe_unpermute
from .positions import WindowIndex, rope_index, rot_pos_emb, vision_positions, window_index
from .rms_norm import rms_norm
from .rope import mrope, mrope_, vision_rope
from .swiglu import swiglu
from . import nn  # noqa: E402  (modules; after the ops they use)

__all__ = ["Permuted", "WindowIndex", "dual_gemm", "dual_gemm_out", "fp8_gemm", "fp8_linear", "fp8_quantize",
           "linear_cross_entropy",
           "moe_permute", "moe_unpermute", "mrope", "mrope_", "rms_norm", "rope_index", "rot_pos_emb", "swiglu",
           "vision_positions", "vision_rope", "window_index"]
__version__ = "0.1.0"
