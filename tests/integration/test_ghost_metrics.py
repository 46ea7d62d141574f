"""Capacity planning through a real daemon: the ghost caches see every LOOKUP key, count
the tier's real hits at scale 1, and show in STATS, `kvtierd stats` and /metrics alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.workload import run_workload
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)


def test_ghosts_estimate_larger_tiers_from_the_real_access_stream(daemon_factory):
    d = daemon_factory("--nvme-bytes", "0", cpu_bytes="4MiB")
    seen = run_workload(d.address)
    stats = d.stats()
    cpu, ghost, counts = stats["tiers"]["cpu"], stats["ghosts"]["cpu"], stats["counts"]
    assert cpu["evictions"] > 0, "the workload must overflow the tier"
    # every access counted, and scale 1 is exactly the tier's own hits
    assert ghost["sample_ratio"] == 1.0
    # (LOOKUP keys only: the GETs that follow are the same chunk requests, not new accesses)
    assert ghost["accesses"] == seen["lookups"] < seen["lookups"] + seen["gets"]
    assert seen["hits"] == counts["lookup_hits"]
    assert ghost["hits"]["1"] == counts.get("lookup_hits_cpu", 0)
    if "nvme" in stats["ghosts"]:  # behind the CPU tier: a hit in either counts at scale 1
        assert stats["ghosts"]["nvme"]["hits"]["1"] == seen["hits"]
    # 2x holds every chunk this workload stored (60 chunks of 2 pages in 128 pages)
    assert ghost["capacity_bytes"] == {"1": 4 << 20, "2": 8 << 20, "4": 16 << 20}
    assert ghost["hits"]["1"] < ghost["hits"]["2"] == ghost["hits"]["4"] <= ghost["accesses"]
    assert ghost["keys"]["2"] == ghost["keys"]["4"] == 60

    # the same numbers on /metrics
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(d.metrics_text()) for s in f.samples}
    assert samples[("kvtierd_ghost_accesses_total", frozenset({("tier", "cpu")}))] == \
        ghost["accesses"]
    for scale in ("1", "2", "4"):
        key = ("kvtierd_ghost_hits_total", frozenset({("tier", "cpu"), ("scale", scale)}))
        assert samples[key] == ghost["hits"][scale]
    assert samples[("kvtierd_ghost_sample_ratio", frozenset({("tier", "cpu")}))] == 1.0

    # and in the CLI's table
    out = subprocess.run([sys.executable, "-m", "kvtierd", "stats", "--socket", d.address],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    planning = out.split("capacity planning", 1)[1].splitlines()
    assert planning[1].split() == ["tier", "accesses", "now", "at", "2x", "at", "4x", "sampled"]
    row = planning[2].split()
    ratio = lambda h: f"{h / ghost['accesses']:.1%}"  # noqa: E731
    assert row == ["cpu", str(ghost["accesses"]), ratio(ghost["hits"]["1"]),
                   ratio(ghost["hits"]["2"]), ratio(ghost["hits"]["4"]), "100.0%"]
