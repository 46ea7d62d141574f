"""KVTierClient refuses chunks it cannot copy before anything reaches the daemon: a group that is
not offloaded, the wrong number of block ids, block ids outside the KV cache. Each error names the
value and what is allowed; the client keeps working afterwards (a real daemon, random pages)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.kv import assert_chunk_equals, chunk_pages, poison, random_kv

from kvtier_client import Chunk, KVGroup, KVLayout, KVTierClient

pytestmark = pytest.mark.timeout(60)

BLOCKS = (96, 40)


def layout_with_skipped_group() -> KVLayout:
    """Group 0 is offloaded; group 1 (8 tokens per block, hashes of 16) cannot be keyed."""
    return KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=4096, layer_names=("a0", "a1")),
                KVGroup(tokens_per_block=8, page_bytes=2048, layer_names=("b0",))],
        blocks_per_chunk=2, tokens_per_hash=16, model="checks", dtype="bfloat16")


def chunk(layout: KVLayout, group: int, block_ids: tuple, key: bytes = b"k" * 16) -> Chunk:
    return Chunk(key=key, group=group, block_ids=block_ids, token_start=0, token_end=32,
                 nbytes=layout.chunk_nbytes(0))


def assert_round_trip(client: KVTierClient, layout: KVLayout, kv: dict, good: Chunk) -> None:
    """``good`` stores, and loads back byte-exact into poisoned blocks."""
    expected = chunk_pages(layout, kv, good)
    assert client.store([good]).result(timeout=30) == [True]
    poison(kv)
    assert client.load([good]).result(timeout=30) == [True]
    assert_chunk_equals(layout, kv, good, expected)


@pytest.mark.parametrize("group, block_ids, message", [
    (1, (0, 1), r"chunk group 1 is not an offloadable group of this layout; allowed: \[0\]"),
    (7, (0, 1), r"chunk group 7 is not an offloadable group of this layout; allowed: \[0\]"),
    (-1, (0, 1), r"chunk group -1 is not an offloadable group"),
    (0, (0, 1, 2), r"group 0: chunk has 3 block ids; allowed: exactly blocks_per_chunk=2"),
    (0, (5,), r"group 0: chunk has 1 block ids; allowed: exactly blocks_per_chunk=2"),
    (0, (3, 96), r"group 0: block ids \[96\] are outside the KV cache; allowed: 0\.\.95 or -1"),
    (0, (-2, 4), r"group 0: block ids \[-2\] are outside the KV cache; allowed: 0\.\.95 or -1"),
    (0, (-5, 200), r"block ids \[-5, 200\] are outside the KV cache"),
], ids=["skipped-group", "no-such-group", "negative-group", "three-ids", "one-id", "id-past-end",
        "id-minus-two", "both-ends"])
def test_bad_chunks_are_refused_by_every_call_and_the_client_keeps_working(
        daemon, group, block_ids, message):
    layout = layout_with_skipped_group()
    kv = random_kv(layout, BLOCKS, torch.Generator().manual_seed(len(message)))
    good = chunk(layout, 0, (3, 17), key=random.Random(group).randbytes(16))
    bad = chunk(layout, group, block_ids)
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        for call in (client.store, client.load, client.lookup, client.delete):
            with pytest.raises(ValueError, match=message):
                call([good, bad])  # refused whole: the good chunk is not stored either
        assert client.lookup([good]) == [False]
        assert_round_trip(client, layout, kv, good)
    daemon.check()


def test_block_id_minus_one_and_the_cache_bounds_are_accepted(daemon):
    """-1 (no block: nothing copied) and the first and last block are valid ids."""
    layout = layout_with_skipped_group()
    kv = random_kv(layout, BLOCKS, torch.Generator().manual_seed(3))
    edges = chunk(layout, 0, (0, 95), key=b"e" * 16)
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert client.lookup([edges, chunk(layout, 0, (-1, 95), key=b"m" * 16)]) == [False, False]
        assert_round_trip(client, layout, kv, edges)
    daemon.check()
