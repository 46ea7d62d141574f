"""Give the C heap's free pages back to the kernel once the indexes are loaded.

Why: a start that reads its index from the rows (after a crash, or an index without a snapshot)
allocates and frees tens of bytes of temporaries per chunk (row tuples, decoded fields, run lists)
between the objects that stay (key bytes, dict tables, columns). glibc keeps the freed memory in
its heap, scattered between live blocks, so the daemon's resident memory stays that much higher
for its whole life. ``malloc_trim(0)`` returns every whole free page inside the heap
(``madvise(MADV_DONTNEED)``), not just its top: measured at 1M chunks loaded from rows
(``benchmarks/index_scale.py``), 247 -> 220 bytes of daemon memory per indexed chunk. It takes
milliseconds, once, before serving. Other C libraries (musl) have no such call: nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Callable

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> bool:
    """Release the heap's free pages; True if this C library can (glibc), whether or not any
    page was free."""
    fn = _malloc_trim()
    if fn is None:
        log.debug("malloc_trim is not available (not glibc): the heap keeps its free pages")
        return False
    fn(0)
    return True


class IdleTrim:
    """``trim`` again after the daemon served requests, once it has had a whole housekeeping tick
    without one, at most every ``min_interval_s``: requests free their temporaries (item lists,
    entries, replies) into the heap as start-up's loads do (100k chunks stored through PUTs:
    294 -> 268 B of daemon memory per chunk with it), and a trim walks the heap (0.3-3 ms at
    100k chunks), so it runs while nobody waits and not after every burst."""

    def __init__(self, min_interval_s: float = 10.0) -> None:
        self.min_interval_s = min_interval_s
        self._served = False  # requests since the last trim
        self._this_tick = False  # requests since the last tick
        self._last = float("-inf")
        self.trims = 0

    def served(self) -> None:
        """Requests were handled (called by the loop when its socket had any)."""
        self._served = self._this_tick = True

    def tick(self, now: float) -> bool:
        """Called every housekeeping tick; True when it trimmed."""
        if self._this_tick:
            self._this_tick = False
            return False
        if not self._served or now - self._last < self.min_interval_s:
            return False
        self._served, self._last = False, now
        self.trims += 1
        return trim()
