"""Rare garbage collections while the daemon serves.

Why: a 4096-item batch allocates tens of thousands of tracked objects (item lists, entries, job
tuples), nearly all freed by reference counting. At the default gen-0 threshold (700) that was a
collection every ~100 items and a full one every few batches, each over every live entry and
queued job: 0.8 s of collections in 8 s of 16 KiB PUT/GET (measured with ``gc.callbacks``).
Collections stay on (cycles are still freed), just rare, and what start-up built (modules, config,
metrics) is frozen out of them: it lives as long as the daemon.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

#: gen-0, gen-1, gen-2 thresholds while serving.
THRESHOLDS = (50_000, 20, 10)


@contextlib.contextmanager
def rare_collections() -> Iterator[None]:
    """Serve with ``THRESHOLDS`` and start-up's objects frozen; the previous setting after."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
