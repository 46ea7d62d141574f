"""The tier chain's remote side through real daemons: two "nodes" (separate sockets, arenas, NVMe
dirs) sharing one remote store, where the remote is a real second tier
(``helpers.dir_remote``) so this runs in CI where Mooncake is absent. Node A stores (published on
commit); node B, which has never seen the keys, answers LOOKUP ``REMOTE`` after one batched
existence check and loads byte-exact; a flipped byte in a remote object is a miss with
``kvtierd_integrity_failures_total{tier="remote"}``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.daemon import DaemonProcess
from helpers.nvme import InlineSession, flip_byte, index_rows, metric, payload, wait_for

from kvtierd.protocol import Status, Tier

pytestmark = pytest.mark.timeout(120)

SERVE = Path(__file__).resolve().parent.parent / "helpers" / "dir_remote_serve.py"
CHUNK = 300 * 1024 + 123  # ends inside a page


def node(workdir: Path, remote: Path, *flags: str, **kwargs) -> DaemonProcess:
    d = DaemonProcess(workdir, list(flags), launcher=[sys.executable, str(SERVE), str(remote)],
                      **kwargs)
    d.start()
    return d


@pytest.fixture
def nodes(tmp_path):
    started: list[DaemonProcess] = []

    def start(name: str, *flags: str, **kwargs) -> DaemonProcess:
        started.append(node(tmp_path / name, tmp_path / "remote", *flags, **kwargs))
        return started[-1]

    yield start
    for d in started:
        d.stop_and_verify()
        d.remove_nvme_data()
    (tmp_path / "remote" / "chunks.data").unlink(missing_ok=True)


def published(d: DaemonProcess, count: int) -> None:
    wait_for(lambda: d.stats()["tiers"]["remote"]["chunks"] == count or None, 30,
             f"{count} chunks published to the remote")


def test_node_b_finds_node_a_chunks_remote_and_loads_them_exactly(nodes, tmp_path):
    data = {f"k{i}".encode(): payload(("remote", i), CHUNK) for i in range(6)}
    a = nodes("a")
    with InlineSession(a.address) as s:
        assert s.put(data) == [Status.OK] * len(data)
    published(a, len(data))
    a.stop_and_verify()  # node A is gone; the remote store keeps its chunks

    b = nodes("b")
    with InlineSession(b.address) as s:
        assert s.lookup(list(data) + [b"absent"]) == [Tier.REMOTE] * len(data) + [Tier.NONE]
        results, frames, errors = s.get({k: len(v) for k, v in data.items()})
        assert results == [Status.OK] * len(data), errors
        assert frames == list(data.values()), "bytes from the remote differ"
        assert s.lookup(list(data)) == [Tier.CPU] * len(data)  # promoted into B's arena
    m = b.metrics_text()
    assert metric(m, "kvtierd_hits_total", tier="remote") == len(data)
    assert metric(m, "kvtierd_promotions_total") == len(data)
    assert metric(m, "kvtierd_bytes_total", direction="promote", tier="remote") == \
        len(data) * CHUNK
    assert metric(m, "kvtierd_tier_available", tier="remote") == 1


def test_a_chunk_only_the_remote_holds_is_stored_locally_when_put_again(nodes):
    """Issue 38 item 1: a PUT of a key node B knows only from the shared remote (an engine that
    recomputed a remote hit) is stored in B's own tiers, not answered EXISTS: the remote copy is
    not on this node."""
    data = {f"r{i}".encode(): payload(("recomputed", i), CHUNK) for i in range(4)}
    a = nodes("a")
    with InlineSession(a.address) as s:
        assert s.put(data) == [Status.OK] * len(data)
    published(a, len(data))
    a.stop_and_verify()  # one daemon holds the remote directory at a time
    b = nodes("b")
    with InlineSession(b.address) as s:
        assert s.lookup(list(data)) == [Tier.REMOTE] * len(data)
        assert s.put(data) == [Status.OK] * len(data)  # before: EXISTS, nothing stored here
        assert s.lookup(list(data)) == [Tier.CPU] * len(data)
        results, frames, errors = s.get({k: len(v) for k, v in data.items()})
        assert results == [Status.OK] * len(data), errors
        assert frames == list(data.values())
        assert s.put(data) == [Status.EXISTS] * len(data)  # now it is here
    assert metric(b.metrics_text(), "kvtierd_promotions_total") == 0


def test_a_mixed_leased_lookup_answers_and_counts_every_tier_once(nodes):
    """One LOOKUP batch of CPU hits, keys only the remote has (known after its existence
    check), misses and another layout's key, interleaved, leased: each answered and counted by
    its tier, the leases held and released (CHECK at stop verifies the pins), and the remote
    keys then load byte-exact."""
    remote = {f"r{i}".encode(): payload(("mixed", i), CHUNK) for i in range(5)}
    a = nodes("a")
    with InlineSession(a.address) as s:
        assert s.put(remote) == [Status.OK] * len(remote)
    published(a, len(remote))
    a.stop_and_verify()

    b = nodes("b")
    local = {b"c0": payload("c0", CHUNK), b"c1": payload("c1", CHUNK)}
    with InlineSession(b.address, fingerprint="fp-other") as other:
        assert other.put({b"x": payload("x", CHUNK)}) == [Status.OK]
    with InlineSession(b.address) as s:
        assert s.put(local) == [Status.OK, Status.OK]
        keys = [b"c0", b"r0", b"m0", b"r1", b"x", b"c1", b"r2", b"m1", b"r3", b"r4"]
        c, r, n = Tier.CPU, Tier.REMOTE, Tier.NONE
        expected = [c, r, n, r, n, c, r, n, r, r]
        assert s.lookup(keys, lease=True) == expected
        assert b.check()  # the leases of remote entries are pinned consistently
        assert s.lookup(keys) == expected  # from what B learned (and the absent cache)
        m = b.metrics_text()
        assert metric(m, "kvtierd_hits_total", tier="cpu") == 4
        assert metric(m, "kvtierd_hits_total", tier="remote") == 10
        assert metric(m, "kvtierd_misses_total", reason="miss") == 4
        assert metric(m, "kvtierd_misses_total", reason="layout_mismatch") == 2
        results, frames, errors = s.get({k: CHUNK for k in remote})
        assert results == [Status.OK] * len(remote), errors
        assert frames == list(remote.values()), "bytes from the remote differ"
        assert s.lookup(list(remote)) == [Tier.CPU] * len(remote)


def test_a_flipped_byte_in_a_remote_object_is_a_miss_with_the_integrity_metric(nodes, tmp_path):
    data = {b"good": payload("good", CHUNK), b"bad": payload("bad", CHUNK)}
    a = nodes("a")
    with InlineSession(a.address) as s:
        assert s.put(data) == [Status.OK, Status.OK]
    published(a, 2)
    a.stop_and_verify()
    remote = tmp_path / "remote"
    row = next(r for (ns, _, key), r in index_rows(remote).items() if key == b"bad")
    flip_byte(remote / "chunks.data", 64 * 1024, row["runs"], offset_in_chunk=CHUNK // 2)

    b = nodes("b")
    with InlineSession(b.address) as s:
        assert s.lookup([b"good", b"bad"]) == [Tier.REMOTE, Tier.REMOTE]
        results, frames, errors = s.get({k: CHUNK for k in data})
        assert results[0] == Status.OK and frames[0] == data[b"good"]
        assert results[1] == Status.CHECKSUM_MISMATCH and frames[1] == b"", errors
        assert s.lookup([b"bad"]) == [Tier.NONE], "a corrupt remote object is still offered"
    m = b.metrics_text()
    assert metric(m, "kvtierd_integrity_failures_total", tier="remote") == 1
    assert "checksum mismatch" in b.log()


def test_on_evict_remote_gets_only_what_leaves_the_local_tiers(nodes):
    data = {f"e{i}".encode(): payload(("evict", i), CHUNK) for i in range(12)}
    a = nodes("a", "--nvme-bytes", "0", cpu_bytes="2MiB",
              env={"KVTIERD_REMOTE_PUBLISH": "on-evict"})
    with InlineSession(a.address) as s:
        for key, value in data.items():  # one at a time: the arena holds ~6
            assert s.put({key: value}) == [Status.OK]
        wait_for(lambda: a.stats()["tiers"]["cpu"]["demoting_bytes"] == 0 or None, 30,
                 "demotions done")
        where = dict(zip(data, s.lookup(list(data))))
        in_arena = [k for k, t in where.items() if t == Tier.CPU]
        remote = [k for k, t in where.items() if t == Tier.REMOTE]
        assert in_arena and remote and len(in_arena) + len(remote) == len(data), where
        assert a.stats()["tiers"]["remote"]["chunks"] == len(remote), "on-evict published more"
        results, frames, _ = s.get({k: CHUNK for k in remote})
        assert results == [Status.OK] * len(remote)
        assert frames == [data[k] for k in remote]
