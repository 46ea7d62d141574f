"""Two kvtierd daemons as two nodes sharing one real Mooncake Store (in a private namespace).

Node A stores, node B (its own socket, arena and NVMe directory) answers LOOKUP ``REMOTE`` and
loads byte-exact into poisoned blocks; with the master killed both keep serving their local tiers
and the remote tier comes back when the master does.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from helpers import mooncake as mc
from helpers.nvme import metric
from helpers.wait import wait_for

from kvtier_client import KVGroup, KVLayout, KVTierClient
from kvtier_client.index import KVTierIndex
from kvtierd.protocol import Tier

pytestmark = [pytest.mark.skipif(mc.unavailable_reason() is not None,
                                 reason=str(mc.unavailable_reason())),
              pytest.mark.slow]  # two daemons and a master: ~10 s each

PAGE = 8192


@pytest.fixture
def master(tmp_path_factory) -> mc.MooncakeMaster:
    return mc.shared_master(tmp_path_factory.getbasetemp() / "mooncake")


@pytest.fixture
def nodes(master, daemon_factory, tmp_path):
    """Daemons A and B in the master's namespace, one cluster id of their own."""
    cluster = f"nodes-{uuid.uuid4().hex[:12]}"

    def start(name: str, **remote):
        config = tmp_path / f"{name}.toml"
        config.write_text(master.remote_toml(**{"cluster_id": cluster, **remote}))
        return daemon_factory("--config", str(config), preexec_fn=master.ns.preexec)

    return start


def layout() -> KVLayout:
    return KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=PAGE,
                                    layer_names=("l0", "l1"))],
                    blocks_per_chunk=4, tokens_per_hash=16, model="tiny-remote", dtype="bfloat16")


def random_kv(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, (64, PAGE), dtype=torch.uint8, generator=gen)
            for n in ("l0", "l1")}


def tiers_of(daemon, lay: KVLayout, chunks) -> list[Tier]:
    index = KVTierIndex(daemon.address, namespace=lay.namespace, rank=lay.rank,
                        fingerprint=lay.fingerprint, timeout_s=20.0)
    try:
        return index.lookup([c.key for c in chunks])
    finally:
        index.close()


def metrics(master, daemon) -> str:
    with master.ns.entered():  # the daemon's exporter listens inside the namespace
        return daemon.metrics_text()


def store(daemon, lay, chunks, kv) -> None:
    with KVTierClient.connect(daemon.address, layout=lay, kv_caches=kv) as client:
        assert all(client.store(chunks).result(timeout=30))


def published(master, daemon, count: int):
    return lambda: metric(metrics(master, daemon), "kvtierd_bytes_total", direction="write_through",
                          tier="remote") >= count * 2 * 4 * PAGE


def flip_stored(raw, name: str, offset: int) -> None:
    """Flip one bit of the object ``name`` in the store (``offset`` into payload + header; the
    caller is inside the master's namespace)."""
    from kvtierd.remote import objects

    stored = bytearray(raw.get(name))
    assert len(stored) == objects.HEADER_BYTES + 2 * 4 * PAGE, "not where expected"
    stored[offset] ^= 0x10
    assert raw.remove(name, True) == 0
    assert raw.put(name, bytes(stored)) == 0


def test_node_b_answers_remote_and_loads_what_node_a_stored(master, nodes) -> None:
    a, b = nodes("a"), nodes("b", global_segment_bytes=0)
    lay = layout()
    kv = random_kv(7)
    tokens = torch.randint(0, 50000, (640,), generator=torch.Generator().manual_seed(7)).tolist()
    chunks = lay.plan(tokens, [list(range(40))])
    expected = {(n, blk): kv[n][blk].clone() for c in chunks for n in ("l0", "l1")
                for blk in c.block_ids}
    store(a, lay, chunks, kv)
    wait_for(published(master, a, len(chunks)), 30, "node A published its chunks (on-commit)")
    assert tiers_of(b, lay, chunks) == [Tier.REMOTE] * len(chunks)
    other = KVLayout(groups=lay.groups, blocks_per_chunk=4, tokens_per_hash=16,
                     model="another-model", dtype="bfloat16")
    assert tiers_of(b, other, chunks) == [Tier.NONE] * len(chunks)  # another layout: a miss
    for t in kv.values():
        t.fill_(0xAB)  # poison
    with KVTierClient.connect(b.address, layout=lay, kv_caches=kv) as client:
        assert all(client.lookup(chunks))
        assert all(client.load(chunks).result(timeout=30))
    for (n, blk), page in expected.items():
        assert torch.equal(kv[n][blk], page), (n, blk)
    text = metrics(master, b)
    assert metric(text, "kvtierd_hits_total", tier="remote") >= len(chunks)
    assert metric(text, "kvtierd_integrity_failures_total", tier="remote") == 0
    # promoted into B's arena: the next LOOKUP is a CPU hit
    assert tiers_of(b, lay, chunks) == [Tier.CPU] * len(chunks)


def test_master_down_both_nodes_serve_locally_and_recover(master, nodes) -> None:
    a, b = nodes("a"), nodes("b", global_segment_bytes=0)
    lay = layout()
    kv = random_kv(11)
    gen = torch.Generator().manual_seed(11)
    first = lay.plan(torch.randint(0, 50000, (320,), generator=gen).tolist(), [list(range(20))])
    store(a, lay, first, kv)
    wait_for(published(master, a, len(first)), 30, "node A published")
    master.kill()
    try:
        # A serves from its arena; B (never had them) misses, answering instead of hanging
        assert tiers_of(a, lay, first) == [Tier.CPU] * len(first)
        assert tiers_of(b, lay, first) == [Tier.NONE] * len(first)
        wait_for(lambda: metric(metrics(master, b), "kvtierd_tier_available", tier="remote") == 0,
                 30, "node B's remote circuit opened")
        local = lay.plan(torch.randint(0, 50000, (320,), generator=gen).tolist(),
                         [list(range(20, 40))])
        store(b, lay, local, kv)  # B's local tiers keep storing...
        assert tiers_of(b, lay, local) == [Tier.CPU] * len(local)  # ...and serving
    finally:
        master.start()
    # the restarted master has lost the old metadata; new chunks flow between the nodes again.
    # A's first on-commit writes may still meet the open circuit (then those chunks stay local,
    # and re-storing a key A holds is a no-op), so each try stores new keys (new tokens).
    kv2 = random_kv(12)

    def recovered() -> bool:
        fresh = lay.plan(torch.randint(0, 50000, (320,), generator=gen).tolist(),
                         [list(range(40, 60))])
        store(a, lay, fresh, kv2)
        try:
            wait_for(published(master, a, len(first) + len(fresh)), 3, "published")
        except AssertionError:
            return False
        return tiers_of(b, lay, fresh) == [Tier.REMOTE] * len(fresh)

    wait_for(recovered, 60, "remote tier recovered after the master restart", interval_s=1.0)
    assert metric(metrics(master, b), "kvtierd_tier_available", tier="remote") == 1


def cut_stored(raw, name: str) -> None:
    """Cut the object ``name`` to half its length (inside the master's namespace)."""
    stored = raw.get(name)
    assert raw.remove(name, True) == 0
    assert raw.put(name, stored[: len(stored) // 2]) == 0


@pytest.mark.parametrize("damage", ["flipped-byte", "cut-in-half"])
def test_a_damaged_remote_object_is_a_miss_counted_and_removed(master, nodes, damage) -> None:
    """A flipped byte, or (issue 38 item 3) an object cut to half its length, which used to be
    a plain miss on every GET, counted as nothing but get_results, and promised by every node's
    LOOKUP until Mooncake evicted it."""
    from kvtierd.remote import objects

    cluster = f"flip-{uuid.uuid4().hex[:12]}"
    a, b = nodes("a", cluster_id=cluster), nodes("b", cluster_id=cluster, global_segment_bytes=0)
    lay = layout()
    kv = random_kv(21)
    tokens = torch.randint(0, 50000, (64,), generator=torch.Generator().manual_seed(21)).tolist()
    chunks = lay.plan(tokens, [list(range(4))])
    assert len(chunks) == 1
    store(a, lay, chunks, kv)
    wait_for(published(master, a, 1), 30, "node A published")
    tenant = f"uid:{os.getuid()}"
    name = objects.object_name(cluster, ((tenant, lay.namespace, lay.rank), chunks[0].key),
                               lay.fingerprint)
    raw = mc.raw_client(master, segment_bytes=0)
    try:
        with master.ns.entered():
            if damage == "flipped-byte":
                flip_stored(raw, name, 7)  # a payload byte (the header follows the payload)
            else:
                cut_stored(raw, name)
        assert tiers_of(b, lay, chunks) == [Tier.REMOTE]
        for t in kv.values():
            t.fill_(0xAB)
        with KVTierClient.connect(b.address, layout=lay, kv_caches=kv) as client:
            assert client.load(chunks).result(timeout=30) == [False]
        for n in ("l0", "l1"):
            for blk in chunks[0].block_ids:
                assert bool((kv[n][blk] == 0xAB).all()), "corrupt bytes reached the client"
        assert metric(metrics(master, b), "kvtierd_integrity_failures_total", tier="remote") == 1
        with master.ns.entered():
            wait_for(lambda: raw.is_exist(name) == 0, 30, "the corrupt object removed")
        assert tiers_of(b, lay, chunks) == [Tier.NONE]
    finally:
        with master.ns.entered():
            raw.close()


def test_one_bad_object_in_a_batched_fetch_fails_only_itself(master, nodes) -> None:
    """One GET of many remote chunks is read in batched jobs (one ``batch_get_into`` for all, not
    one per chunk): an object with a flipped payload byte, one with a flipped header byte and one
    removed from the store are misses for those three items only; the others land byte-exact."""
    from kvtierd.remote import objects

    cluster = f"batch-{uuid.uuid4().hex[:12]}"
    a, b = nodes("a", cluster_id=cluster), nodes("b", cluster_id=cluster, global_segment_bytes=0)
    lay = layout()
    kv = random_kv(31)
    tokens = torch.randint(0, 50000, (640,), generator=torch.Generator().manual_seed(31)).tolist()
    chunks = lay.plan(tokens, [list(range(40))])
    assert len(chunks) == 10
    expected = {(n, blk): kv[n][blk].clone() for c in chunks for n in ("l0", "l1")
                for blk in c.block_ids}
    store(a, lay, chunks, kv)
    wait_for(published(master, a, len(chunks)), 30, "node A published")
    tenant = f"uid:{os.getuid()}"
    names = [objects.object_name(cluster, ((tenant, lay.namespace, lay.rank), c.key),
                                 lay.fingerprint) for c in chunks]
    payload_flip, header_flip, gone = 2, 5, 8
    raw = mc.raw_client(master, segment_bytes=0)
    try:
        with master.ns.entered():
            # the payload comes first, then the header (its tenant digest at byte 36)
            flip_stored(raw, names[payload_flip], 7)
            flip_stored(raw, names[header_flip], 36 - objects.HEADER_BYTES)
        assert tiers_of(b, lay, chunks) == [Tier.REMOTE] * len(chunks)
        with master.ns.entered():
            assert raw.remove(names[gone], True) == 0  # after B's LOOKUP found it
        for t in kv.values():
            t.fill_(0xAB)  # poison
        with KVTierClient.connect(b.address, layout=lay, kv_caches=kv) as client:
            results = client.load(chunks).result(timeout=30)
        bad = {payload_flip, header_flip, gone}
        assert results == [i not in bad for i in range(len(chunks))]
        for i, chunk in enumerate(chunks):
            for n in ("l0", "l1"):
                for blk in chunk.block_ids:
                    if i in bad:
                        assert bool((kv[n][blk] == 0xAB).all()), f"unverified bytes of chunk {i}"
                    else:
                        assert torch.equal(kv[n][blk], expected[(n, blk)]), (i, n, blk)
        text = metrics(master, b)
        assert metric(text, "kvtierd_integrity_failures_total", tier="remote") == 2
        assert metric(text, "kvtierd_promotions_total") == len(chunks) - len(bad)
        jobs = metric(text, "kvtierd_tier_io_duration_seconds_count", tier="remote",
                      op="promote")
        assert 1 <= jobs < len(chunks), f"{jobs} read jobs for one GET of {len(chunks)} chunks"
        with master.ns.entered():  # the corrupt ones are removed, the good ones stay
            wait_for(lambda: not raw.is_exist(names[payload_flip])
                     and not raw.is_exist(names[header_flip]), 30, "corrupt objects removed")
            assert all(raw.is_exist(names[i]) == 1 for i in range(len(chunks)) if i not in bad)
        assert tiers_of(b, lay, chunks) == [Tier.CPU if i not in bad else Tier.NONE
                                            for i in range(len(chunks))]
    finally:
        with master.ns.entered():
            raw.close()


def test_a_recomputed_remote_hit_is_stored_locally(master, nodes) -> None:
    """Issue 38 item 1: B's LOOKUP answers REMOTE; its engine recomputes the chunks (say the fetch
    failed) and stores them again. Before, every item was SIZE_MISMATCH (the existence check's
    record has no size) and the chunks could never be cached on B; now they are stored in B's
    own tiers and load from there."""
    a, b = nodes("a"), nodes("b", global_segment_bytes=0)
    lay = layout()
    kv = random_kv(11)
    tokens = torch.randint(0, 50000, (320,), generator=torch.Generator().manual_seed(11)).tolist()
    chunks = lay.plan(tokens, [list(range(20))])
    store(a, lay, chunks, kv)
    wait_for(published(master, a, len(chunks)), 30, "node A published its chunks (on-commit)")
    assert tiers_of(b, lay, chunks) == [Tier.REMOTE] * len(chunks)
    recomputed = {n: t.clone() for n, t in kv.items()}
    store(b, lay, chunks, recomputed)  # asserts every chunk stored
    assert tiers_of(b, lay, chunks) == [Tier.CPU] * len(chunks)
    for t in recomputed.values():
        t.fill_(0x5C)  # poison
    with KVTierClient.connect(b.address, layout=lay, kv_caches=recomputed) as client:
        assert all(client.load(chunks).result(timeout=30))
    for name in ("l0", "l1"):
        for c in chunks:
            for blk in c.block_ids:
                assert torch.equal(recomputed[name][blk], kv[name][blk]), (name, blk)
    text = metrics(master, b)
    assert metric(text, "kvtierd_promotions_total") == 0  # served from B's own arena
