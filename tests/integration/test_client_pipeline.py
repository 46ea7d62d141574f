"""KVTierClient's pipelined store/load (``kvtier_client.pipeline``) through a real daemon.

Calls many times larger than the staging buffer, so the staging ring laps with two requests in
flight; hits and misses mixed in every piece; and a daemon that allows one batch in flight (a
client that sent two would be answered BUSY and fail the call). Random pages, poisoned caches
before loads, every byte checked.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.bad_input import write_toml
from helpers.kv import (assert_chunk_equals, assert_chunk_poisoned,
                        assert_untouched_outside, chunk_pages, poison, random_kv)

from kvtier_client import Chunk, KVGroup, KVLayout, KVTierClient
from kvtier_client.staging import align

pytestmark = pytest.mark.timeout(120)

BLOCKS = (96, 64)


def two_groups() -> KVLayout:
    """Chunks of two sizes (24 KiB and 12 KiB), one group with per-layer page sizes."""
    return KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=(4096, 2048, 6144),
                        layer_names=("a0", "a1", "a2")),
                KVGroup(tokens_per_block=16, page_bytes=3072, layer_names=("b0", "b1"))],
        blocks_per_chunk=2, tokens_per_hash=16, model="pipeline", dtype="bfloat16")


def random_chunks(layout: KVLayout, rng: random.Random, blocks_per_group=BLOCKS) -> list[Chunk]:
    """Every block of every group in some chunk (distinct blocks), groups interleaved."""
    out = []
    for g, blocks in enumerate(blocks_per_group):
        ids = rng.sample(range(blocks), blocks)
        for i in range(0, blocks, 2):
            out.append(Chunk(key=rng.randbytes(16), group=g, block_ids=tuple(ids[i:i + 2]),
                             token_start=8 * i, token_end=8 * i + 32,
                             nbytes=layout.chunk_nbytes(g)))
    rng.shuffle(out)
    return out


def staging_for(layout: KVLayout, chunks: int) -> int:
    return align(max(layout.chunk_nbytes(g) for g in range(len(layout.groups)))) * chunks


@pytest.mark.parametrize("halves", [False, True], ids=["host-default", "half-staging-pieces"])
@pytest.mark.parametrize("staging_chunks", [2, 3, 7])
def test_calls_far_larger_than_staging_store_and_load_every_byte(daemon, staging_chunks, halves):
    """Host caches: by default a piece fills staging (one in flight at a time); with pieces of
    half the buffer two are in flight, the next gathered while the daemon copies the last."""
    rng = random.Random(staging_chunks)
    layout = two_groups()
    kv = random_kv(layout, BLOCKS, torch.Generator().manual_seed(staging_chunks))
    chunks = random_chunks(layout, rng)  # 80 chunks: the ring laps >= 10 times
    expected = {c.key: chunk_pages(layout, kv, c) for c in chunks}
    staging = staging_for(layout, staging_chunks)
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv, staging_bytes=staging,
                              piece_bytes=staging // 2 if halves else None) as client:
        assert client.store(chunks).result(timeout=60) == [True] * len(chunks)
        poison(kv)
        rng.shuffle(chunks)  # another order than the store's: other pieces, other offsets
        assert client.load(chunks).result(timeout=60) == [True] * len(chunks)
    for c in chunks:
        assert_chunk_equals(layout, kv, c, expected[c.key])
    assert_untouched_outside(layout, kv, chunks)
    daemon.check()


def test_misses_in_every_piece_are_false_and_leave_their_blocks_alone(daemon):
    rng = random.Random(5)
    layout = two_groups()
    kv = random_kv(layout, BLOCKS, torch.Generator().manual_seed(5))
    chunks = random_chunks(layout, rng)
    stored = [c for i, c in enumerate(chunks) if i % 3 != 1]
    expected = {c.key: chunk_pages(layout, kv, c) for c in stored}
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv,
                              staging_bytes=staging_for(layout, 4)) as client:
        assert all(client.store(stored).result(timeout=60))
        poison(kv)
        got = client.load(chunks).result(timeout=60)
    assert got == [i % 3 != 1 for i in range(len(chunks))]
    for i, c in enumerate(chunks):
        if got[i]:
            assert_chunk_equals(layout, kv, c, expected[c.key])
        else:
            assert_chunk_poisoned(layout, kv, c)
    assert_untouched_outside(layout, kv, stored)


def test_a_daemon_that_allows_one_batch_in_flight_gets_one(daemon_factory, tmp_path):
    config = write_toml(tmp_path / "one.toml", "max_in_flight_requests = 1\n")
    d = daemon_factory("--config", str(config))
    # 384 KiB chunks: a piece's copy is past the daemon's inline size, so its batch stays in
    # flight on a copy thread while the next piece is gathered (and would be refused BUSY)
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=65536,
                                      layer_names=("c0", "c1", "c2"))],
                      blocks_per_chunk=2, tokens_per_hash=16, model="one", dtype="bfloat16")
    kv = random_kv(layout, (32,), torch.Generator().manual_seed(9))
    chunks = random_chunks(layout, random.Random(9), (32,))
    expected = {c.key: chunk_pages(layout, kv, c) for c in chunks}
    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv,  # two pieces in flight
                              staging_bytes=staging_for(layout, 6),
                              piece_bytes=staging_for(layout, 3)) as client:
        for _ in range(3):  # a BUSY piece would fail the call (DaemonError)
            assert all(client.store(chunks).result(timeout=60))
            poison(kv)
            assert all(client.load(chunks).result(timeout=60))
            for c in chunks:
                assert_chunk_equals(layout, kv, c, expected[c.key])
            client.delete(chunks)  # the next round's store copies again
