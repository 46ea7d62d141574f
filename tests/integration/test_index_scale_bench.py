"""Smoke test of benchmarks/index_scale.py --quick: real daemons, tiny sizes; checks the shape of
its JSON and that every row was measured (never its timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def run_quick(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    """``index_scale.py --quick`` with ``flags``: its JSON and its printed table."""
    out = tmp_path / "index_scale.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/index_scale.py"), "--quick", *flags,
         "--json", str(out)], capture_output=True, text=True, timeout=220, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


def test_index_scale_quick_runs_and_reports_every_row(tmp_path):
    result, stdout = run_quick(tmp_path)
    assert result["quick"] is True
    for part in ("put_path", "warm_arena", "nvme"):
        assert result[part]["chunks"] > 0 and result[part]["bytes_per_chunk"] > 0, result[part]
    for part in ("warm_arena", "nvme"):
        assert result[part]["restart_s"] > 0 and result[part]["empty_restart_s"] > 0
        assert result[part]["restart_cpu_s"] > 0 and result[part]["empty_restart_cpu_s"] > 0
        # a clean restart (from the snapshot its stop wrote) and that stop, beside the rows
        assert result[part]["snapshot_restart_s"] > 0 and result[part]["stop_s"] > 0
        assert result[part]["snapshot_bytes_per_chunk"] > 0
    assert set(result["warm_arena"]["lookup"]) == {"1", "64", "1024"}
    for rates in result["warm_arena"]["lookup"].values():
        assert rates["keys_per_s"] > 0 and rates["ping_keys_per_s"] > 0
    for row in ("memory per chunk, warm arena", "restart to serving, NVMe, clean stop (snapshot)",
                "restart to serving, NVMe, after SIGKILL (rows)", "clean stop, warm arena",
                "LOOKUP keys/s, 1024-key batches"):
        assert row in stdout
    # Its own names: other benchmarks may run beside this one.
    arenas = result["warm_arena"]["arenas"]
    assert len(arenas) == 2 and all(name.startswith("kvtierd-bench-") for name in arenas)
    left = [p for name in arenas for p in Path("/dev/shm").glob(f"{name}*")]
    assert not left, f"the benchmark left its arenas: {left}"


def test_index_scale_only_restart_runs_just_the_restart_rows(tmp_path):
    result, stdout = run_quick(tmp_path, "--only", "restart")
    assert "put_path" not in result and "lookup" not in result["warm_arena"]
    for part in ("warm_arena", "nvme"):
        assert len(result[part]["restart_runs_s"]) == 1 and result[part]["restart_sys_s"] >= 0
        assert len(result[part]["snapshot_restart_runs_s"]) == len(result[part]["stop_runs_s"])
    assert "restart to serving, warm arena" in stdout and "LOOKUP" not in stdout


def test_index_scale_only_lookup_reports_the_lookup_rows_alone(tmp_path):
    result, stdout = run_quick(tmp_path, "--only", "lookup")
    assert set(result) == {"quick", "cpus", "warm_arena"}
    warm = result["warm_arena"]
    assert warm["chunks"] == 3000 and "restart_s" not in warm
    assert set(warm["lookup"]) == {"1", "64", "1024"}
    for rates in warm["lookup"].values():
        assert rates["keys_per_s"] > 0 and rates["ping_keys_per_s"] > 0
    assert "LOOKUP keys/s, 1024-key batches" in stdout and "daemon pid" in stdout
    assert "restart to serving" not in stdout and "memory per chunk" not in stdout
    left = [p for name in warm["arenas"] for p in Path("/dev/shm").glob(f"{name}*")]
    assert not left, f"the benchmark left its arenas: {left}"
