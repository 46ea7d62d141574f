"""How busy the disk under a directory was during a phase, from the kernel's own counters.

``/sys/dev/block/MAJ:MIN/stat`` (Documentation/block/stat.rst) counts, per device, ``io_ticks`` (ms
during which at least one request was in flight) and ``time_in_queue`` (ms summed over every
request in flight: the integral of the queue depth). Their deltas over a phase's wall time say,
without sampling anything, whether a writer or reader kept the device busy (``busy`` ~ 1.0) and
how many requests it kept in flight on average (``depth``): the numbers that tell "the daemon left
the disk idle between rounds" from "the disk itself was slow this time". The counters are the
whole device's, so another process's I/O in the same phase is counted too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SECTOR = 512


def stat_path(directory: Path) -> Path | None:
    """The ``stat`` file of the block device holding ``directory`` (None: not a block device,
    e.g. tmpfs or overlay without a backing device)."""
    dev = os.stat(directory).st_dev
    path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return path if path.exists() else None


@dataclass(frozen=True)
class Reading:
    t: float
    fields: tuple[int, ...]


def read(path: Path | None) -> Reading | None:
    if path is None:
        return None
    return Reading(time.perf_counter(), tuple(int(x) for x in path.read_text().split()))


def delta(before: Reading | None, after: Reading | None, wall_s: float | None = None
          ) -> dict[str, float]:
    """``busy`` (fraction of the wall time with I/O in flight), ``depth`` (mean requests in
    flight; a 2 MiB transfer is several requests where the device's max_segments cuts it),
    ``read_mib``/``write_mib`` moved and the mean request size in KiB per direction. ``wall_s``:
    the phase's own length where the readings span more (fio's runtime, without its start-up)."""
    if before is None or after is None:
        return {}
    d = [a - b for a, b in zip(after.fields, before.fields)]
    wall_ms = (wall_s if wall_s is not None else after.t - before.t) * 1000.0
    reads, read_sectors, writes, write_sectors = d[0], d[2], d[4], d[6]
    return {
        "wall_s": wall_ms / 1000.0,
        "busy": min(1.0, d[9] / wall_ms) if wall_ms else 0.0,
        "depth": d[10] / wall_ms if wall_ms else 0.0,
        "read_mib": read_sectors * SECTOR / 2**20,
        "write_mib": write_sectors * SECTOR / 2**20,
        "read_kib_per_io": read_sectors * SECTOR / 1024 / reads if reads else 0.0,
        "write_kib_per_io": write_sectors * SECTOR / 1024 / writes if writes else 0.0,
        # ext4 mounted with ``discard`` trims a deleted file's blocks at a later journal commit:
        # another run's deletions can land in this phase (fields 12-15: discards)
        "discard_mib": d[13] * SECTOR / 2**20 if len(d) > 13 else 0.0,
        "flushes": d[15] if len(d) > 15 else 0,
    }


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid``'s main thread (the daemon's loop) and of all its
    threads, from /proc (clock ticks)."""
    hz = os.sysconf("SC_CLK_TCK")
    total = loop = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        cpu = (int(fields[11]) + int(fields[12])) / hz  # utime, stime (fields 14, 15)
        total += cpu
        if task.name == str(pid):
            loop = cpu
    return {"loop": loop, "all": total}
