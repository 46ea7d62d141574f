"""A DELETE batch through a real daemon: every key keeps its own outcome (OK, MISS, BUSY-free
neighbours, LAYOUT_MISMATCH left alone, bad keys), leases are released, the ghosts forget the
keys, survivors keep their bytes, and the invariants hold. Run with and without an NVMe tier:
without one (and without kv-events) the CPU tier deletes the batch by slots
(kvtierd.tiers.cpu_batch), with one the chain deletes key by key."""

from __future__ import annotations

import random

import pytest
from helpers.bad_input import POISON, Session, names

from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(90)

SIZE = 16 * 1024
COUNT = 40


@pytest.mark.parametrize("nvme_bytes", ["0", "64MiB"])
def test_a_delete_batch_keeps_every_keys_outcome(daemon_factory, memfd, nvme_bytes):
    d = daemon_factory(cpu_bytes="64MiB", nvme_bytes=nvme_bytes)
    rng = random.Random(7 + len(nvme_bytes))
    buf = memfd(COUNT * SIZE)
    payload = rng.randbytes(COUNT * SIZE)
    buf.write(0, payload)
    theirs = memfd(SIZE)  # a memfd goes to one session only (the daemon seals it)
    theirs.write(0, payload[:SIZE])
    a = Session(d.address, "deletes", staging=buf, fingerprint="fp-a")
    other = Session(d.address, "deletes", staging=theirs, fingerprint="fp-b")
    try:
        keys = [f"chunk-{i}".encode() for i in range(COUNT)]
        assert names(a.put([[k, i * SIZE, SIZE] for i, k in enumerate(keys)])["results"]) == (
            ["OK"] * COUNT)
        assert names(other.put([[b"theirs", 0, SIZE]])["results"]) == ["OK"]
        reply, _ = a.request(Op.LOOKUP, keys=keys[:4], lease=True)  # leased, then deleted
        assert reply["name"] == "OK" and all(reply["tiers"])
        ghost_keys = d.stats()["ghosts"]["cpu"]["keys"]["2"]

        gone = keys[: COUNT // 2]
        batch = gone + [b"never-stored", gone[0], b"theirs", "not-bytes", b"x" * 65]
        reply, _ = a.request(Op.DELETE, keys=batch)
        assert reply["name"] == "OK", reply
        assert names(reply["results"]) == (["OK"] * len(gone) + [
            "MISS", "MISS", "LAYOUT_MISMATCH", "BAD_REQUEST", "KEY_TOO_LONG"])
        assert d.stats()["ghosts"]["cpu"]["keys"]["2"] == ghost_keys - len(gone)

        buf.fill(POISON, 0, COUNT * SIZE)
        reply, _ = a.get([[k, i * SIZE, SIZE] for i, k in enumerate(keys)])
        assert names(reply["results"]) == ["MISS"] * len(gone) + ["OK"] * (COUNT - len(gone))
        for i in range(len(gone), COUNT):
            assert buf.read(i * SIZE, SIZE) == payload[i * SIZE:(i + 1) * SIZE], i
        assert buf.read(0, SIZE) == bytes([POISON]) * SIZE
        reply, _ = other.get([[b"theirs", 0, SIZE]])
        assert names(reply["results"]) == ["OK"]  # another layout's chunk was left alone
        assert d.check()["chunks"] == COUNT - len(gone) + 1  # raises if an invariant broke
        # The deleted keys can be stored again, in the pages the DELETE freed.
        assert names(a.put([[k, i * SIZE, SIZE] for i, k in enumerate(gone)])["results"]) == (
            ["OK"] * len(gone))
        assert d.check()["chunks"] == COUNT + 1
    finally:
        a.close()
        other.close()
