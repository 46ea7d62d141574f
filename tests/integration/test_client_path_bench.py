"""``benchmarks/client_path.py --quick`` runs end to end (a real daemon, real client): a smoke
test of the script and its output shape, never of its speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_quick_run_prints_the_table_and_writes_every_figure(tmp_path):
    out = tmp_path / "client_path.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "client_path.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "store/ceil" in done.stdout and "8KiB" in done.stdout, done.stdout
    result = json.loads(out.read_text())
    assert result["quick"] is True and set(result["cases"]) == {"8KiB", "32KiB"}
    for case in result["cases"].values():
        assert case["batch_bytes"] % case["chunk_bytes"] == 0 and case["batch_bytes"] > 0
        for key in ("store_ratio", "load_ratio", "store_gbs", "load_gbs", "ceiling_gbs",
                    "torch_gather_gbs", "torch_scatter_gbs", "overlap_gain",
                    "store_ratio_serial", "load_ratio_serial", "daemon_put_gbs",
                    "daemon_get_gbs"):
            assert case[key] > 0, key
        lo, hi = case["store_ratio_range"]
        assert lo <= case["store_ratio"] <= hi
        assert set(case["rounds"][0]) == {"store", "load", "gather", "copy", "gather_py",
                                           "both", "daemon_put", "daemon_get"}
