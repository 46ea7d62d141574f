"""How many of the machine's cores were busy over a stretch of a benchmark (Linux ``/proc/stat``).

A ratio against a peer means something else on a machine whose every core the peer already keeps
busy: then any work of ours (hashing what was fetched, say) takes cores from the transfer instead
of hiding behind it. ``benchmarks/remote_tier.py`` prints this beside its ratios.
"""

from __future__ import annotations

import os
from pathlib import Path

STAT = Path("/proc/stat")


def _jiffies() -> tuple[int, int] | None:
    """(all, idle + iowait) jiffies of the machine since boot, or None without ``/proc/stat``."""
    try:
        fields = STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:9]]  # guest time is already counted in user
    return sum(values), values[3] + values[4]


class CoresBusy:
    """``load = CoresBusy()``, the work, then ``load.stop()``: the average number of cores that
    were busy (any process: a peer's server too) in between; None where the kernel does not say
    or no tick passed."""

    def __init__(self) -> None:
        self._start = _jiffies()

    def stop(self) -> float | None:
        end = _jiffies()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        total, idle = end[0] - self._start[0], end[1] - self._start[1]
        return (1 - idle / total) * (os.cpu_count() or 1)
