"""GPU tests: every test here is marked ``gpu`` and skipped, with the reason, where CUDA is absent.

Run them with ``benchmarks/gpu_check.sh`` on a machine with an NVIDIA GPU (or
``pytest -m gpu tests/gpu`` where kvtierd's dependencies and CuPy are installed).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def gpu_unavailable() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'kvtierd[cuda]')"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # no driver, driver too old for this CuPy
        return f"CuPy cannot use CUDA: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    here = str(Path(__file__).parent)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            reason = gpu_unavailable()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))
