"""benchmarks/nvme_tier.py --quick: the NVMe benchmark runs end to end on tiny sizes (real daemons,
real files) and writes the documented shape — interleaved (daemon, raw) pairs with per-pair ratios,
their median and minimum. Its numbers are not checked: they mean nothing at these sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_writes_interleaved_pairs_with_median_and_min_ratios(tmp_path):
    out = tmp_path / "nvme.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/nvme_tier.py", "--quick", "--raw", "python",
         "--dir", str(tmp_path / "disk"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    row = result["sizes"]["2MiB"]
    assert len(row["pairs"]) == 2 and result["repeat"] == 2
    for pair in row["pairs"]:
        daemon, raw = pair["daemon"], pair["raw"]
        assert daemon["demoted_bytes"] > 0 and daemon["promoted_bytes"] > 0
        assert daemon["promote_misses"] == 0
        assert pair["demote_ratio"] == pytest.approx(daemon["demote_gbs"] / raw["write_gbs"])
        assert pair["promote_ratio"] == pytest.approx(daemon["promote_gbs"] / raw["read_gbs"])
    for key in ("demote_ratio", "promote_ratio"):
        ratios = [p[key] for p in row["pairs"]]
        assert row[key]["min"] == min(ratios)
        assert min(ratios) <= row[key]["median"] <= max(ratios)
    assert result["restart"]["indexed_chunks"] >= 300
    assert "ratio med" in done.stdout  # the table was printed
    assert not list((tmp_path / "disk").iterdir()), "the benchmark left files behind"
