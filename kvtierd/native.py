"""Which of kvtierd's compiled parts run (``setup.py`` builds them; each is optional): the
daemon's start-up line carries this, so an operator sees at once a build that fell back to the
Python forms (the same results, slower for small chunks)."""

from __future__ import annotations

from kvtierd import ghost, key_sample
from kvtierd.copy import memcpy
from kvtierd.eviction import lru
from kvtierd.server import requests
from kvtierd.tiers import columns


def summary() -> str:
    """E.g. ``host copies: compiled copies and xxh3, index columns: compiled, ...``."""
    return ", ".join(f"{what}: {native}" for what, native in (
        ("host copies", memcpy.NATIVE), ("index columns", columns.NATIVE),
        ("request items", requests.NATIVE), ("lru stamps", lru.NATIVE),
        ("ghost sampling", key_sample.NATIVE), ("ghosts", ghost.NATIVE)))
