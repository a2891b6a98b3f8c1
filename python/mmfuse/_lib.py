"""Loads the compiled extension (``_C.so``), which registers the ``torch.ops.mmfuse`` operators.

A missing or broken build is an ImportError that says what to do; there is no silent fallback.
``MMFUSE_LIBRARY`` may point at a ``_C.so`` built elsewhere (as ``tools/gpu-check`` does).
"""

import glob
import os

import torch


def _load() -> str:
    path = os.environ.get("MMFUSE_LIBRARY")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        found = sorted(glob.glob(os.path.join(here, "_C*.so")))
        if not found:
            raise ImportError(
                f"mmfuse: the compiled extension _C.so is missing from {here}. Build it with "
                "`pip install --no-build-isolation .` (torch must be installed first), or set "
                "MMFUSE_LIBRARY to the path of a built _C.so."
            )
        path = found[0]
    torch.ops.load_library(path)
    return path


LIBRARY_PATH = _load()
