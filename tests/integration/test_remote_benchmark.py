"""Smoke tests of the remote-tier benchmark and the Mooncake peer (output shape only, never
timing): each runs in its own process, since a process's Mooncake clients share one namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mooncake as mc

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(mc.unavailable_reason() is not None,
                                 reason=str(mc.unavailable_reason())),
              pytest.mark.slow]  # a master, a store process and a few MiB each way: ~10 s


def test_remote_tier_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "remote_tier.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/remote_tier.py"), "--quick",
                           "--json", str(out), "--workdir", str(tmp_path / "mc")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["sizes"]) == {str(256 * 1024), str(2 * 1024**2)}
    for row in results["sizes"].values():
        for side in ("mooncake", "kvtierd"):
            assert row[side]["store_gbps"] > 0 and row[side]["load_gbps"] > 0
        assert {"store_ratio", "load_ratio", "store_ratio_median", "load_ratio_median"} <= set(row)
        assert row["mooncake_verified"]["load_gbps"] > 0
        busy = row["mooncake"]["load_cores_busy"]  # None only when no tick passed (tiny --quick)
        assert busy is None or 0 <= busy <= results["cpu_count"]
        assert row["mooncake_verified"]["vs_raw_median"] > 0
        shaped = row["mooncake_shaped"]
        for way in ("store", "load"):
            assert shaped[f"{way}_gbps"] > 0 and shaped[f"{way}_ratio_median"] > 0
            assert shaped[f"{way}_vs_raw_median"] > 0
        assert len(row["rounds"]) == results["rounds"]
    assert [r["keys"] for r in results["lookup"]] == [1, 64, 1024]
    assert "median of rounds" in done.stdout and "lookup keys" in done.stdout
    assert "mooncake + xxh3" in done.stdout and "it / mooncake, median" in done.stdout
    assert "mooncake as kvtierd" in done.stdout


def test_mooncake_peer_rows(tmp_path: Path) -> None:
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, 'benchmarks'); "
            "from peers import mooncake; "
            f"print(json.dumps(mooncake.run([262144], 1, Path({str(tmp_path)!r}))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 1
    row = rows[0]
    assert {k: row[k] for k in ("peer", "path", "chunk_bytes")} == {
        "peer": "mooncake", "path": "raw bytes", "chunk_bytes": 262144}
    assert row["store_gbps"] > 0 and row["load_gbps"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_remote_tier_benchmark_pins_the_transfer_and_the_verifiers_apart(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    out = tmp_path / "remote_tier.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/remote_tier.py"), "--quick",
                           "--only", "transfers", "--transfer-cpus", str(cpus[0]), "--json",
                           str(out), "--workdir", str(tmp_path / "mc")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["transfer_cpus"] == cpus[:1] and results["verify_cpus"] == cpus[1:]
    assert f"verifier threads on {cpus[1:]}" in done.stdout
    for row in results["sizes"].values():
        assert row["kvtierd"]["load_gbps"] > 0


@pytest.mark.parametrize("spec", ["0-4096", "x", "all"])
def test_remote_tier_benchmark_refuses_a_cpu_split_it_cannot_make(tmp_path: Path, spec) -> None:
    spec = ",".join(map(str, sorted(os.sched_getaffinity(0)))) if spec == "all" else spec
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/remote_tier.py"), "--quick",
                           "--transfer-cpus", spec, "--json", str(tmp_path / "r.json"),
                           "--workdir", str(tmp_path / "mc")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and f"--transfer-cpus {spec!r}" in done.stderr, done.stderr
    assert not (tmp_path / "r.json").exists()
