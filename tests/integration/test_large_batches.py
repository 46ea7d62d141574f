"""Batches large enough to be cut into several copy jobs (kvtierd.server.batch): every item keeps
its own outcome, bytes are exact, and metrics, hit accounting and ghosts count per item exactly as
before, although the daemon now updates them once per job or per batch. Run with and without an
NVMe tier, since the daemon takes a shorter path per item without one."""

from __future__ import annotations

import random

import pytest
from helpers.bad_input import POISON, Session, item_errors, names
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(90)

STAGE = 24 * 1024**2
SIZES = (16 * 1024, 64 * 1024, 100_000)  # under a page, a page, two pages not filled


def samples(daemon) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(daemon.metrics_text())
            for s in family.samples}


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.mark.parametrize("nvme_bytes", ["0", "64MiB"])
def test_a_batch_of_many_jobs_keeps_every_items_outcome_and_counts(daemon_factory, memfd,
                                                                    nvme_bytes):
    d = daemon_factory(cpu_bytes="64MiB", nvme_bytes=nvme_bytes)
    rng = random.Random(12 + len(nvme_bytes))
    buf = memfd(STAGE)
    payload = rng.randbytes(STAGE)
    buf.write(0, payload)
    s = Session(d.address, "batches", staging=buf)
    try:
        s.put([[b"already", 0, SIZES[0]]])  # EXISTS below
        items, expected, stored = [], [], {}
        offset = 0
        for i in range(260):
            size = SIZES[i % len(SIZES)]
            key = f"chunk-{i}".encode()
            items.append([key, offset, size])
            expected.append("OK")
            stored[key] = (offset, size)
            offset += size
            if i % 37 == 5:  # bad items between good ones, spread over the jobs
                items += [["not-bytes", 0, size], [b"oob", STAGE - 10, size],
                          [b"x" * 65, 0, size], [key, 0, size], [b"already", 0, SIZES[0]]]
                expected += ["BAD_REQUEST", "OUT_OF_BOUNDS", "KEY_TOO_LONG", "BUSY", "EXISTS"]
        assert offset < STAGE
        before = samples(d)
        reply = s.put(items)
        assert names(reply["results"]) == expected
        errors = item_errors(reply)
        for index, (name, message) in errors.items():
            assert name == expected[index] and message, (index, name, message)
        assert "PUT of this key is already in flight" in next(
            m for n, m in errors.values() if n == "BUSY")

        # Read everything back at other offsets (reversed order), plus misses and a wrong size.
        buf.fill(POISON, 0, STAGE)
        keys = list(stored)[::-1]
        gets, where, out = [], {}, 0
        for key in keys:
            gets.append([key, out, stored[key][1]])
            where[key] = out
            out += stored[key][1]
        gets += [[b"never-stored", 0, 4096], [keys[0], 0, stored[keys[0]][1] + 1]]
        reply, frames = s.get(gets)
        assert frames == []
        assert names(reply["results"]) == ["OK"] * len(keys) + ["MISS", "SIZE_MISMATCH"]
        for key in keys:
            src, size = stored[key]
            assert buf.read(where[key], size) == payload[src : src + size], key
        assert buf.read(out, 4096) == bytes([POISON]) * 4096

        after = samples(d)
        stored_bytes = sum(size for _, size in stored.values())
        assert delta(before, after, "kvtierd_bytes_total", direction="in", tier="cpu") == (
            stored_bytes)
        assert delta(before, after, "kvtierd_bytes_total", direction="out", tier="cpu") == (
            stored_bytes)
        assert delta(before, after, "kvtierd_get_results_total", result="ok") == len(keys)
        assert delta(before, after, "kvtierd_get_results_total", result="miss") == 1
        assert delta(before, after, "kvtierd_get_results_total", result="size_mismatch") == 1
        assert delta(before, after, "kvtierd_requests_total", op="put", status="OK") == 1
        assert delta(before, after, "kvtierd_requests_total", op="get", status="OK") == 1
        ghosts = d.stats()["ghosts"]["cpu"]
        assert ghosts["sample_ratio"] == 1.0
        assert ghosts["keys"]["2"] == len(stored) + 1  # every stored key and "already"
        assert d.check()["chunks"] == len(stored) + 1  # raises if an invariant is violated
    finally:
        s.close()
