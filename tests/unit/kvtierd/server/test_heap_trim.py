"""heap_trim: a fragmented glibc heap's free pages really go back to the kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvtierd.server import heap_trim

# In a fresh interpreter: 2 KiB bytes objects come from malloc (not pymalloc); keeping every 16th
# leaves the freed ones scattered inside the heap, where free() alone never returns them.
PROBE = textwrap.dedent("""
    from kvtierd.server import heap_trim

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    blocks = [bytes([i % 251]) * 2048 for i in range(60_000)]  # ~120 MiB, every page touched
    kept = blocks[::16]
    del blocks
    before = rss_kib()
    assert heap_trim.trim()
    after = rss_kib()
    assert all(b[0] == (i * 16) % 251 and len(b) == 2048 for i, b in enumerate(kept))
    print(before, after)
""")


def test_trim_returns_the_free_pages_of_a_fragmented_heap():
    if heap_trim._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    # ~112 MiB freed but resident until the trim; the kept 1/16 and the interpreter remain.
    assert before - after > 64 * 1024, (before, after)


def test_idle_trim_waits_for_an_idle_tick_after_requests_and_keeps_its_interval():
    idle = heap_trim.IdleTrim(min_interval_s=10.0)
    assert not idle.tick(0.0), "nothing served yet: nothing to give back"
    idle.served()
    assert not idle.tick(0.1), "requests during this tick: not now"
    trimmed = idle.tick(0.2)  # a whole tick without requests
    assert idle.trims == 1 and trimmed == (heap_trim._malloc_trim() is not None)
    assert not idle.tick(0.3) and idle.trims == 1, "idle since the trim: nothing new to free"
    idle.served()
    assert not idle.tick(5.0) and not idle.tick(5.1) and idle.trims == 1, "within the interval"
    idle.tick(10.3)
    assert idle.trims == 2
