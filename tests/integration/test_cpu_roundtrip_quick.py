"""benchmarks/cpu_roundtrip.py --quick: every row runs against a real daemon and the JSON has the
shape the README's table is built from (its numbers mean nothing at these sizes: not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # ~20 s: a daemon, torch, an echo server


def test_quick_run_reports_every_size_against_memcpy(tmp_path):
    out = tmp_path / "cpu_roundtrip.json"
    done = subprocess.run([sys.executable, "benchmarks/cpu_roundtrip.py", "--quick", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=110,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert list(result["sizes"]) == ["16KiB", "64KiB", "256KiB"]
    for label, row in result["sizes"].items():
        # stream: the daemon's own streaming copy in the ceiling's loop (the test build has it)
        for name in ("put_gbs", "get_gbs", "memcpy_gbs", "stream_gbs", "put_ratio", "get_ratio",
                     "put_ratio_median", "get_ratio_median"):
            assert row[name] > 0, (label, name, row)
        assert row["put_ratio"] == pytest.approx(row["put_gbs"] / row["memcpy_gbs"])
        assert row["items_per_request"] >= 4
    assert result["ping_p50_us"] > 0 and result["zmq_p50_us"] > 0
    assert result["lookup_keys_per_s"] > 0
    for label in result["sizes"]:
        assert label in done.stdout  # the printed table has a row per size
