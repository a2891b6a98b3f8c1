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
