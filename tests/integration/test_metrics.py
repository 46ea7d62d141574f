"""/metrics after a real workload: names, types and values agree with the workload and STATS."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.kv import random_kv, random_tokens, simple_layout
from prometheus_client.parser import text_string_to_metric_families

from kvtier_client import KVTierClient

pytestmark = pytest.mark.timeout(60)

CHUNK_TOKENS = 64


def scrape(daemon) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """(family name -> type, (sample name, labels) -> value) of one /metrics scrape."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(daemon.metrics_text()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} missing; have " + ", ".join(
        sorted(f"{n}{dict(l)}" for n, l in samples if n == name))
    return samples[key]


def total(samples, name: str, **labels: str) -> float:
    """Sum over every label set of ``name`` that includes ``labels``."""
    want = set(labels.items())
    return sum(v for (n, l), v in samples.items() if n == name and want <= l)


def test_metrics_agree_with_the_workload_and_stats(daemon_factory):
    d = daemon_factory(cpu_bytes="4MiB", page_bytes="64KiB", nvme_bytes="0")
    layout = simple_layout(page_bytes=16000, layers=2, blocks_per_chunk=4, model="metrics")
    chunk_bytes = layout.chunk_nbytes(0)
    gen = torch.Generator().manual_seed(51)
    sizes = [10, 10, 20, 20]
    kv = random_kv(layout, [100 * len(sizes) + 100], gen)
    plans = [layout.plan(random_tokens(gen, n * CHUNK_TOKENS + 3),
                         [list(range(100 * p, 100 * (p + 1)))]) for p, n in enumerate(sizes)]
    never = layout.plan(random_tokens(gen, 5 * CHUNK_TOKENS), [list(range(400, 480))])

    # one request per call (no pipelined pieces): the request counts below are per call
    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv,
                              piece_bytes=64 * 1024**2) as client:
        puts = 0
        for chunks in [plans[0], plans[1], plans[0], plans[2], plans[3]]:  # plans[0] twice: EXISTS
            assert all(client.store(chunks).result(timeout=30))
            puts += 1
        flat = [c for chunks in plans for c in chunks]
        looked = client.lookup(flat) + client.lookup(never)
        loaded = client.load(flat).result(timeout=30)
        hits = sum(looked)  # one count per chunk asked about: the LOOKUP answer
        misses = len(looked) - hits
        assert 0 < sum(loaded) < len(flat), "the workload should both hit and miss"

        stats = d.stats()
        cpu = stats["tiers"]["cpu"]
        types, samples = scrape(d)
        assert cpu["evictions"] > 0

        expected_types = {
            "kvtierd_tier_capacity_bytes": "gauge", "kvtierd_tier_used_bytes": "gauge",
            "kvtierd_tier_chunks": "gauge", "kvtierd_requests": "counter",
            "kvtierd_request_duration_seconds": "histogram", "kvtierd_hits": "counter",
            "kvtierd_misses": "counter", "kvtierd_evictions": "counter",
            "kvtierd_sessions": "gauge", "kvtierd_bytes": "counter",
            "kvtierd_get_results": "counter",
        }
        assert {n: types.get(n) for n in expected_types} == expected_types

        # tiers: the same numbers as STATS
        assert value(samples, "kvtierd_tier_capacity_bytes", tier="cpu") == cpu["capacity_bytes"]
        assert value(samples, "kvtierd_tier_used_bytes", tier="cpu") == cpu["used_bytes"]
        assert value(samples, "kvtierd_tier_chunks", tier="cpu", state="ready") == cpu["chunks"]
        assert value(samples, "kvtierd_tier_chunks", tier="cpu", state="pending") == 0
        assert value(samples, "kvtierd_evictions_total", tier="cpu") == cpu["evictions"]
        assert cpu["chunks"] == sum(loaded)

        # requests by op and status, and one latency observation per answered request
        assert value(samples, "kvtierd_requests_total", op="put", status="OK") == puts
        assert value(samples, "kvtierd_requests_total", op="get", status="OK") == 1
        assert value(samples, "kvtierd_requests_total", op="lookup", status="OK") == 2
        assert value(samples, "kvtierd_requests_total", op="hello", status="OK") == 1
        for op, count in [("put", puts), ("get", 1), ("lookup", 2)]:
            assert value(samples, "kvtierd_request_duration_seconds_count", op=op) == count
            assert value(samples, "kvtierd_request_duration_seconds_sum", op=op) > 0
            buckets = sorted(
                (float(dict(l)["le"]), v) for (n, l), v in samples.items()
                if n == "kvtierd_request_duration_seconds_bucket" and dict(l)["op"] == op)
            assert len(buckets) > 5 and buckets[-1] == (math.inf, count)
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets

        # hits and misses: what the client's LOOKUPs saw, and what STATS counts
        counts = stats["counts"]
        assert value(samples, "kvtierd_hits_total", tier="cpu") == hits
        assert counts["lookup_hits"] == counts["lookup_hits_cpu"] == hits
        assert total(samples, "kvtierd_misses_total") == misses
        assert value(samples, "kvtierd_misses_total", reason="miss") == misses
        assert counts["lookup_misses"] == misses
        # GET outcomes apart: one result per loaded chunk
        assert value(samples, "kvtierd_get_results_total", result="ok") == sum(loaded)
        assert value(samples, "kvtierd_get_results_total", result="miss") == \
            len(loaded) - sum(loaded)
        assert total(samples, "kvtierd_get_results_total") == len(loaded)
        assert (counts["get_served"], counts["get_failed"]) == \
            (sum(loaded), len(loaded) - sum(loaded))

        # bytes: EXISTS re-puts copy nothing
        stored = sum(sizes)
        assert value(samples, "kvtierd_bytes_total", direction="in", tier="cpu") == \
            stored * chunk_bytes
        assert value(samples, "kvtierd_bytes_total", direction="out", tier="cpu") == \
            sum(loaded) * chunk_bytes

        assert value(samples, "kvtierd_sessions") == stats["sessions"] == 1

    _, samples = scrape(d)
    assert value(samples, "kvtierd_sessions") == d.stats()["sessions"] == 0
    assert value(samples, "kvtierd_sessions_closed_total", reason="bye") == 1
    d.check()


def test_a_hit_looked_up_then_loaded_counts_once_so_half_hits_read_half(daemon_factory):
    """Regression: a LOOKUP hit and its GET were both counted as hits, a miss once, so an engine
    whose lookups hit half the time showed a 0.67 hit ratio."""
    d = daemon_factory(cpu_bytes="16MiB", page_bytes="64KiB", nvme_bytes="0")
    layout = simple_layout(page_bytes=16000, layers=2, blocks_per_chunk=4, model="half")
    gen = torch.Generator().manual_seed(52)
    kv = random_kv(layout, [64], gen)
    chunks = layout.plan(random_tokens(gen, 12 * CHUNK_TOKENS + 3), [list(range(64))])
    assert len(chunks) == 12
    stored, new = chunks[:6], chunks[6:]
    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
        assert all(client.store(stored).result(timeout=30))
        # as vLLM's connector does: look up (leasing the hits), then load only the hits
        looked = client.lookup(stored + new, lease=True)
        assert looked == [True] * 6 + [False] * 6
        assert client.load(stored).result(timeout=30) == [True] * 6
    _, samples = scrape(d)
    hits, misses = total(samples, "kvtierd_hits_total"), total(samples, "kvtierd_misses_total")
    assert (hits, misses) == (6, 6)
    assert hits / (hits + misses) == 0.5
    assert value(samples, "kvtierd_get_results_total", result="ok") == 6
