"""benchmarks/cores_busy.py against work whose cores are known: a busy child process per core
asked for (real processes, the real /proc/stat)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import cores_busy  # noqa: E402  (a sibling of the benchmarks, not a package)

SPIN = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass"


@pytest.mark.skipif(not cores_busy.STAT.exists(), reason="no /proc/stat on this system")
def test_spinning_children_count_as_busy_cores() -> None:
    """One spinning process keeps at least most of one core busy, and the count never exceeds
    the machine's cores, even with more spinners than cores."""
    cores = os.cpu_count() or 1
    for spinners in (1, cores + 1):
        load = cores_busy.CoresBusy()
        procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(spinners)]
        for proc in procs:
            assert proc.wait(timeout=30) == 0
        busy = load.stop()
        assert busy is not None
        assert min(spinners, cores) * 0.7 <= busy <= cores + 1e-9, (spinners, busy)


def test_no_proc_stat_means_no_answer(monkeypatch) -> None:
    monkeypatch.setattr(cores_busy, "STAT", Path("/nonexistent/stat"))
    assert cores_busy.CoresBusy().stop() is None

