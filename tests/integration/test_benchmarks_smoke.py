"""Smoke tests of the peer and node-scale benchmarks: they run end to end on tiny sizes against a
real daemon and write the JSON their docstrings promise. Never a timing assertion: the figures of
``--quick`` mean nothing, only their shape and the byte-exact loads are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import each other as scripts do

import peers  # noqa: E402
from peers import lmcache as lmcache_peer  # noqa: E402


def run_script(name: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=BENCH.parent)


def test_vs_peers_quick_measures_kvtierd_and_the_ceiling(tmp_path):
    out = tmp_path / "vs_peers.json"
    proc = run_script("vs_peers.py", "--quick", "--peers", "none", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["peers"] == [] and result["sizes"] == [256 * 1024]
    (repeat,) = result["repeats"]
    rows = {(r["peer"], r["path"]): r for r in repeat["rows"]}
    assert set(rows) == {("kvtierd", peers.PATH_KV), ("kvtierd", peers.PATH_RAW)}
    for row in rows.values():
        assert row["chunk_bytes"] == 256 * 1024
        for key in ("store_gbps", "load_gbps", "memcpy_gbps"):
            assert row[key] > 0, (key, row)
    assert repeat["ratios"] == [] and repeat["skipped"] == {}
    assert "kvtierd   kv tensors" in proc.stdout and "kvtierd   raw bytes" in proc.stdout


def test_vs_peers_refuses_an_unknown_peer_naming_the_known_ones():
    import vs_peers

    with pytest.raises(SystemExit, match=r"nosuchpeer.*allowed.*lmcache"):
        vs_peers.select_peers("lmcache,nosuchpeer")
    assert vs_peers.select_peers("none") == {}
    assert set(vs_peers.select_peers("lmcache")) == {"lmcache"}


def test_peer_modules_are_discovered_without_loading_the_peer():
    found = peers.discover()
    assert found["lmcache"] is lmcache_peer
    # the project's environment never imports LMCache itself: the peer runs in its own venv
    assert "lmcache" not in sys.modules


def test_peer_rows_missing_a_contract_key_are_refused():
    good = {"peer": "p", "path": peers.PATH_RAW, "chunk_bytes": 1, "store_gbps": 1.0,
            "load_gbps": 2.0}
    assert peers.checked_rows("p", [good]) == [good]
    with pytest.raises(ValueError, match="load_gbps"):
        peers.checked_rows("p", [{k: v for k, v in good.items() if k != "load_gbps"}])


def test_ratios_set_each_peer_row_against_kvtierd_on_the_same_path_and_size():
    import vs_peers

    def row(peer, path, size, store, load):
        return {"peer": peer, "path": path, "chunk_bytes": size, "store_gbps": store,
                "load_gbps": load}

    rows = [row("kvtierd", peers.PATH_KV, 8, 3.0, 2.0), row("kvtierd", peers.PATH_RAW, 8, 9.0, 9.0),
            row("lmcache", peers.PATH_KV, 8, 1.0, 4.0), row("other", peers.PATH_RAW, 16, 1.0, 1.0)]
    (x,) = vs_peers.ratios(rows)  # "other" at 16 bytes has no kvtierd row: no ratio
    assert (x["peer"], x["store_x"], x["load_x"]) == ("lmcache", 3.0, 0.5)


def test_kv_geometry_refuses_a_chunk_size_it_cannot_build():
    with pytest.raises(ValueError, match="chunk_bytes=1000"):
        peers.KVGeometry(1000)
    geo = peers.KVGeometry(2 * 1024**2, batch_bytes=8 * 1024**2)
    assert (geo.heads, geo.page_bytes, geo.chunks) == (8, 64 * 1024, 4)
    src, dst = geo.block_ids()
    assert len(set(src + dst)) == 8 and 0 not in src + dst  # block 0 is LMCache's "no block"


@pytest.mark.slow
def test_node_scale_quick_runs_ranks_and_a_scheduler_on_one_daemon(tmp_path):
    out = tmp_path / "node.json"
    proc = run_script("node_scale.py", "--quick", "--ranks", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["all_loads_correct"] is True
    for key in ("store_gbps", "load_gbps", "ceiling_gbps", "store_ratio", "load_ratio"):
        assert result[key] > 0, key
    assert result["lookup_idle"]["n"] > 0 and result["lookup_failures"] == 0
    assert result["lookup_idle"]["p99_ms"] >= result["lookup_idle"]["p50_ms"] > 0
    assert "LOOKUP of 64 keys" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not lmcache_peer.READY.exists(),
                    reason="LMCache's venv is not built here (benchmarks/vs_peers.py --peers "
                           "lmcache builds it once; CI never installs peers)")
def test_vs_peers_quick_against_lmcache(tmp_path):
    out = tmp_path / "vs_peers.json"
    proc = run_script("vs_peers.py", "--quick", "--peers", "lmcache", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (repeat,) = json.loads(out.read_text())["repeats"]
    assert repeat["skipped"] == {}
    (x,) = repeat["ratios"]
    assert x["peer"] == "lmcache" and x["path"] == peers.PATH_KV
    assert x["store_x"] > 0 and x["load_x"] > 0
