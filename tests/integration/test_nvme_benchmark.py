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
sys.path.insert(0, str(REPO / "benchmarks"))
import disk_stats  # noqa: E402  (a sibling of the benchmark, not a package)


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
    raws = row["raws"]  # R D R: the raw tool against itself, judged as a daemon run is
    assert len(raws) == 3 and [p["raw"]["runs"] for p in row["pairs"]] == [raws[:2], raws[1:]]
    for key, gbs in (("raw_self_write_ratio", "write_gbs"), ("raw_self_read_ratio", "read_gbs")):
        assert row[key]["values"] == [
            pytest.approx(raws[1][gbs] / ((raws[0][gbs] + raws[2][gbs]) / 2))]
        assert row[key]["min"] == row[key]["values"][0]
    if disk_stats.stat_path(tmp_path) is not None:  # a block device: its counters per phase
        for pair in row["pairs"]:
            demote, promote = pair["daemon"]["demote_disk"], pair["daemon"]["promote_disk"]
            assert 0 < demote["busy"] <= 1 and 0 < promote["busy"] <= 1
            assert demote["write_mib"] >= pair["daemon"]["demoted_bytes"] / 2**20
        for raw in raws:
            assert raw["write_disk"]["write_mib"] >= raw["bytes"] / 2**20
    assert result["restart"]["indexed_chunks"] >= 300
    # the daemon's own recovery line was found and read on every start (its wording is the log's)
    assert all(s >= 0 for s in result["restart"]["recovery_log_s"]), result["restart"]
    assert "ratio med" in done.stdout and "raw self min" in done.stdout  # the tables
    assert "busy/depth" in done.stdout
    assert not list((tmp_path / "disk").iterdir()), "the benchmark left files behind"
