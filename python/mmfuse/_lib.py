"""Loads the compiled extension (``_C.so``), which registers the ``torch.ops.mmfuse`` operators.

A missing or broken build is an ImportError that says what to do; there is no silent fallback.
``MMFUSE_LIBRARY`` may point at a ``_C.so`` built elsewhere (as ``tools/gpu-check`` does).
"""

import glob
import importlib.machinery
import importlib.util
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


def _module(path: str):
    """The Python module face of _C.so (direct eager entry points), or None when it was built
    without the Python headers."""
    try:
        loader = importlib.machinery.ExtensionFileLoader("mmfuse._C", path)
        spec = importlib.util.spec_from_file_location("mmfuse._C", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return mod
    except ImportError:
        return None


LIBRARY_PATH = _load()
fast = _module(LIBRARY_PATH)
