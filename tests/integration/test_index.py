"""KVTierIndex, the scheduler's lookup-only session, against a real daemon."""

import time

import torch

from kvtier_client import Chunk, KVGroup, KVLayout, KVTierClient
from kvtier_client.index import KVTierIndex
from kvtierd.protocol import Tier


def layout():
    return KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=4096, layer_names=("l0",))],
                    blocks_per_chunk=2, tokens_per_hash=16, model="tiny", dtype="bfloat16")


def test_index_sees_what_a_client_stored_under_its_fingerprint_only(daemon):
    lay = layout()
    kv = {"l0": torch.randint(0, 256, (8, 4096), dtype=torch.uint8)}
    chunks = [Chunk(b"k%d" % i, 0, (2 * i, 2 * i + 1), 0, 0, lay.chunk_nbytes(0)) for i in range(3)]
    with KVTierClient.connect(daemon.address, layout=lay, kv_caches=kv) as client:
        assert all(client.store(chunks[:2]).result(timeout=30))
    index = KVTierIndex(daemon.address, namespace=lay.namespace, rank=0,
                        fingerprint=lay.fingerprint)
    other = KVTierIndex(daemon.address, namespace=lay.namespace, rank=0, fingerprint="f" * 64)
    try:
        assert index.lookup([c.key for c in chunks], lease=True) == [Tier.CPU, Tier.CPU, Tier.NONE]
        assert other.lookup([chunks[0].key]) == [Tier.NONE]  # another layout: a miss, never bytes
    finally:
        index.close()
        other.close()


def test_an_absent_daemon_answers_misses_fast_and_backs_off(tmp_path):
    index = KVTierIndex(f"ipc://{tmp_path}/nobody.sock", namespace="n", rank=0, fingerprint="f",
                        timeout_s=0.2, retry_s=60)
    t0 = time.monotonic()
    assert index.lookup([b"a", b"b"]) == [Tier.NONE, Tier.NONE]
    assert not index.available and index.failures == 1
    assert index.lookup([b"a"]) == [Tier.NONE]  # backing off: not even asked
    assert index.failures == 1 and time.monotonic() - t0 < 2
    index.close()
