"""Make this test process's ``import cupy`` find the CPU stand-in (``cuda_standin/``; control flow
only, NOT GPU verification), undone by ``monkeypatch`` at the end of the test."""

from __future__ import annotations

import sys

from helpers.cuda_standin import cupy as standin_cupy
from helpers.cuda_standin import cupyx as standin_cupyx

from kvtier_client import kernels


def use_standin_cupy(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", standin_cupy)
    monkeypatch.setitem(sys.modules, "cupyx", standin_cupyx)
    monkeypatch.setattr(kernels, "_modules", {})  # no stand-in module outlives the test
