"""Fixtures shared by the tests of kvtierd's top-level modules."""

from __future__ import annotations

import pytest

from kvtierd import ghost as ghost_module
from kvtierd.ghost import GhostLRUPython


@pytest.fixture(params=["compiled", "python"])
def lru(request, monkeypatch):
    """The ghosts' LRU class under test, each form in turn (``kvtierd._ghost.LRU`` and its Python
    form), installed where GhostCaches builds its ghosts. The ghost test modules use it for every
    test (``pytestmark``)."""
    if request.param == "python":
        monkeypatch.setattr(ghost_module, "GhostLRU", GhostLRUPython)
    elif ghost_module.NATIVE != "compiled":
        pytest.skip("kvtierd._ghost was not built (python setup.py build_ext --inplace)")
    return ghost_module.GhostLRU
