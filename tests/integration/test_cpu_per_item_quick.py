"""benchmarks/cpu_per_item.py --quick: both daemons (this checkout and a --compare one, here the
same tree) are driven and the JSON has a row per daemon and chunk size with every op's CPU per item
(its numbers mean nothing at these sizes: only that they were measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # two daemons, torch in the client


def test_quick_run_reports_cpu_per_item_for_every_op(tmp_path):
    out = tmp_path / "cpu_per_item.json"
    done = subprocess.run([sys.executable, "benchmarks/cpu_per_item.py", "--quick", "--compare",
                           str(ROOT), "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=110,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["rounds"] == 1
    assert sorted(result["rows"]) == ["compare 16KiB", "compare 64KiB", "this 16KiB",
                                      "this 64KiB"]
    for name, row in result["rows"].items():
        for op in ("put", "get", "delete"):
            assert row[f"{op}_loop_us"] > 0, (name, op, row)
            assert row[f"{op}_all_us"] >= row[f"{op}_loop_us"], (name, op, row)
        assert name in done.stdout  # the printed table has the row
