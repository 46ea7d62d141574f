"""The NVMe tier through a real daemon and real files: demotion and promotion, write-through,
integrity checks on read, injected disk faults, LRU eviction when full, stats, the directory lock.

Every load goes into poisoned blocks of another block table and is compared byte for byte; every
miss must leave its blocks poisoned. Chunks are ~1 MiB and end inside a daemon page.
"""

from __future__ import annotations

import functools

import json
import subprocess
import sys

import pytest
from helpers.daemon import DaemonProcess
from helpers.nvme import (
    ChunkSet,
    InlineSession,
    fault_config,
    flip_byte,
    index_rows,
    metric,
    nvme_layout,
    payload,
    settled,
    split_tiers,
    tiers,
    wait_for,
    wait_settled,
    write_faults,
)

from kvtier_client import KVTierClient
from kvtierd.protocol import Status, Tier


@pytest.fixture
def daemon_factory(daemon_factory):
    """These tests fill the NVMe tier: give it the room they were written for (the shared
    default is smaller, to keep a whole test run's preallocated files small)."""
    return functools.partial(daemon_factory, nvme_bytes="256MiB")


pytestmark = pytest.mark.timeout(120)

SMALL_CPU = "4MiB"  # three ~1 MiB chunks: everything else is demoted


def nvme_pages(rows: dict, page_bytes: int = 64 * 1024) -> int:
    return sum(count for row in rows.values() for _, count in row["runs"]) * page_bytes


# -- (a) more than the CPU tier holds --------------------------------------------------------------

def test_store_more_than_the_cpu_tier_holds_loads_everything_from_nvme(daemon_factory):
    d = daemon_factory(cpu_bytes=SMALL_CPU)
    layout = nvme_layout()
    cs = ChunkSet(layout, 40, seed=1)  # ~42 MiB: ten times the CPU tier
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client, \
            cs.raw(d.address) as raw:
        assert cs.store(client) == [True] * len(cs)
        t = wait_settled(d)
        cpu, nvme = t["cpu"], t["nvme"]
        assert cpu["chunks"] + nvme["chunks"] == len(cs), t  # nothing lost on the way down
        assert nvme["chunks"] >= len(cs) - 4 and cpu["used_bytes"] <= cpu["capacity_bytes"]
        assert nvme["used_bytes"] == nvme["committed_bytes"] > 0
        # LOOKUP names the tier: the newest chunks are in the arena, the rest on NVMe
        where = split_tiers(raw, cs.keys)
        assert set(where) <= {Tier.CPU, Tier.NVME}, where
        demoted = where[Tier.NVME]
        assert len(demoted) == nvme["chunks"] and len(where.get(Tier.CPU, [])) == cpu["chunks"]
        # the index on disk names exactly the demoted chunks, with this layout's fingerprint
        rows = index_rows(d.workdir / "nvme")
        assert {key for (_, _, key) in rows} == set(demoted)
        assert all(r["fingerprint"] == layout.fingerprint and r["nbytes"] == cs.nbytes
                   for r in rows.values())
        assert nvme_pages(rows) == nvme["used_bytes"]

        m = d.metrics_text()
        demotions = metric(m, "kvtierd_demotions_total")
        assert demotions >= len(demoted)
        assert metric(m, "kvtierd_bytes_total", direction="demote", tier="nvme") == \
            demotions * cs.nbytes
        assert metric(m, "kvtierd_promotions_total") == 0

        # every chunk loads byte-exact: the demoted ones are promoted from NVMe on the way
        assert cs.load(client, what="after demotion") == [True] * len(cs)
        m = d.metrics_text()
        promotions = metric(m, "kvtierd_promotions_total")
        assert promotions >= len(demoted)
        assert metric(m, "kvtierd_bytes_total", direction="promote", tier="nvme") == \
            promotions * cs.nbytes
        assert metric(m, "kvtierd_get_results_total", result="ok") >= len(demoted)
        assert metric(m, "kvtierd_io_failures_total") == 0
        assert metric(m, "kvtierd_integrity_failures_total") == 0
        for op in ("demote", "promote"):  # NVMe job latency is recorded per kind
            assert metric(m, "kvtierd_nvme_io_duration_seconds_count", op=op) > 0, op
        t = wait_settled(d)
        assert metric(m, "kvtierd_nvme_direct_io") == t["nvme"]["direct_io"]
        assert metric(d.metrics_text(), "kvtierd_tier_chunks", tier="nvme", state="ready") == \
            t["nvme"]["chunks"]
        # and again, now that promoted copies and NVMe copies coexist
        assert cs.load(client, what="second load") == [True] * len(cs)
    d.check()


# -- (b) write-through -----------------------------------------------------------------------------

def test_write_through_copies_every_chunk_and_survives_a_cold_restart(daemon_factory):
    d = daemon_factory("--nvme-write-policy", "write-through", cpu_bytes="64MiB")
    layout = nvme_layout("write-through")
    cs = ChunkSet(layout, 12, seed=2)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client:
        assert cs.store(client) == [True] * len(cs)

        def written_through():
            t = settled(d)
            return t if t and t["nvme"]["chunks"] == t["cpu"]["chunks"] else None

        t = wait_for(written_through, 30, "every chunk written through")
        assert t["cpu"]["chunks"] == t["nvme"]["chunks"] == len(cs), t
        assert t["cpu"].get("evictions", 0) == 0  # written through, not demoted
        assert {key for (_, _, key) in index_rows(d.workdir / "nvme")} == set(cs.keys)
        with cs.raw(d.address) as raw:  # both copies exist: LOOKUP names the faster one
            assert raw.lookup(cs.keys) == [Tier.CPU] * len(cs)
        m = d.metrics_text()
        assert metric(m, "kvtierd_bytes_total", direction="write_through", tier="nvme") == \
            len(cs) * cs.nbytes
        assert metric(m, "kvtierd_demotions_total") == 0

        d.stop_and_verify()  # SIGTERM; the arena is private, so the CPU copies die with it
        d.restart()
        t = tiers(d)
        assert t["cpu"]["chunks"] == 0 and t["nvme"]["chunks"] == len(cs), t
        with cs.raw(d.address) as raw:
            assert raw.lookup(cs.keys) == [Tier.NVME] * len(cs)
        # the client re-greets the new daemon by itself
        assert cs.load(client, what="after restart") == [True] * len(cs)
        assert metric(d.metrics_text(), "kvtierd_promotions_total") == len(cs)
    d.check()


def test_delete_during_write_through_is_not_undone(daemon_factory):
    """A DELETE answered OK while the chunk's NVMe write is in flight: the write must not bring the
    chunk back when it completes (it did before the fix: NvmeTier.delete answers BUSY for a WRITING
    entry and the write then committed it)."""
    d = daemon_factory("--nvme-write-policy", "write-through", cpu_bytes="128MiB")
    nbytes = 16 * 1024**2  # its write (+ fdatasync) takes far longer than the DELETE round trip
    keys = [b"deleted-%d" % i for i in range(4)]
    with InlineSession(d.address) as s:
        for key in keys:
            assert s.put({key: payload(key, nbytes)}) == [Status.OK]
            assert s.delete([key]) == [Status.OK]
        wait_settled(d)
        assert s.lookup(keys) == [Tier.NONE] * len(keys), tiers(d)
        results, frames, _ = s.get({k: nbytes for k in keys})
        assert results == [Status.MISS] * len(keys)
        assert index_rows(d.workdir / "nvme") == {}, "a deleted chunk's row is still indexed"
        assert tiers(d)["nvme"]["used_bytes"] == 0
    d.check()


def test_get_whose_cpu_hits_fill_the_arena_still_promotes_its_nvme_items(daemon_factory):
    """A prefix load whose first chunks are in the arena and the rest on NVMe, with the arena
    full: the NVMe items must wait for the arena hits' copies and then be promoted."""
    d = daemon_factory(cpu_bytes=SMALL_CPU)  # 64 pages: three 17-page chunks, 13 pages free
    layout = nvme_layout("cpu-hits-first")
    cs = ChunkSet(layout, 6, seed=6)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client, \
            cs.raw(d.address) as raw:
        for i in range(len(cs)):
            assert cs.store(client, [i]) == [True]
        t = wait_settled(d)
        where = split_tiers(raw, cs.keys)
        in_cpu = [cs.keys.index(k) for k in where[Tier.CPU]]
        on_nvme = [cs.keys.index(k) for k in where[Tier.NVME]]
        free = t["cpu"]["capacity_bytes"] - t["cpu"]["used_bytes"]
        assert len(in_cpu) == 3 and len(on_nvme) == 3 and free < cs.nbytes, t
        hits = cs.load(client, in_cpu + on_nvme, "cpu hits first", per_request=None)
        no_space = metric(d.metrics_text(), "kvtierd_get_results_total", result="no_space")
        assert hits == [True] * len(cs), f"{no_space:.0f} NO_SPACE misses"
    d.check()


# -- (c) a flipped byte in the data file -----------------------------------------------------------

def test_flipped_byte_on_nvme_is_a_miss_and_dropped(daemon_factory):
    d = daemon_factory(cpu_bytes=SMALL_CPU)
    layout = nvme_layout("flip")
    cs = ChunkSet(layout, 12, seed=3)
    nvme_dir = d.workdir / "nvme"
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client, \
            cs.raw(d.address) as raw:
        assert cs.store(client) == [True] * len(cs)
        wait_settled(d)
        demoted = split_tiers(raw, cs.keys)[Tier.NVME]
        assert len(demoted) >= 6
        victim = cs.keys.index(demoted[2])
        row = index_rows(nvme_dir)[(layout.namespace, layout.rank, cs.keys[victim])]
        assert row["nbytes"] == cs.nbytes
        flip_byte(nvme_dir / "chunks.data", 64 * 1024, row["runs"],
                  offset_in_chunk=cs.nbytes // 2 + 13)

        hits = cs.load(client, what="after the flip")  # misses are checked to stay poisoned
        assert hits == [i != victim for i in range(len(cs))], hits
        m = d.metrics_text()
        assert metric(m, "kvtierd_integrity_failures_total", tier="nvme") == 1
        assert metric(m, "kvtierd_integrity_failures_total", tier="cpu") == 0
        assert metric(m, "kvtierd_get_results_total", result="checksum_mismatch") == 1
        # the chunk is gone from both tiers and, once its delete committed, from the index
        assert raw.lookup([cs.keys[victim]]) == [Tier.NONE]
        assert client.lookup([cs.loaded[victim]]) == [False]
        wait_settled(d)
        rows = index_rows(nvme_dir)
        assert (layout.namespace, layout.rank, cs.keys[victim]) not in rows
        assert len(rows) == tiers(d)["nvme"]["chunks"]
        assert "checksum mismatch" in d.log()
        # nothing else was harmed: a second load still serves every other chunk
        assert cs.load(client, what="second load") == hits
        assert metric(d.metrics_text(), "kvtierd_integrity_failures_total", tier="nvme") == 1
    d.check()


# -- (d) injected faults ---------------------------------------------------------------------------

def test_enospc_and_eio_drop_chunks_but_the_daemon_keeps_serving(daemon_factory, tmp_path):
    faults = tmp_path / "faults.json"
    d = daemon_factory("--config", str(fault_config(tmp_path / "cfg", faults)),
                       cpu_bytes=SMALL_CPU)
    layout = nvme_layout("faults")
    cs = ChunkSet(layout, 30, seed=4)
    first, during, after = range(0, 8), range(8, 20), range(20, 30)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client, \
            cs.raw(d.address) as raw:
        assert cs.store(client, first) == [True] * len(first)
        before = wait_settled(d)["nvme"]
        assert before["chunks"] >= 5

        # ENOSPC on every write: PUTs still succeed (into the arena), demotions fail and drop
        write_faults(faults, {"write": "ENOSPC"})
        assert cs.store(client, during) == [True] * len(during)
        t = wait_settled(d)
        assert t["nvme"]["chunks"] == before["chunks"], "a write failed with ENOSPC was indexed"
        assert t["nvme"].get("write_failures", 0) > 0
        m = d.metrics_text()
        assert metric(m, "kvtierd_io_failures_total", tier="nvme", reason="enospc") > 0
        assert any("ERROR" in line and ("ENOSPC" in line or "No space left" in line)
                   for line in d.log().splitlines()), d.log()[-2000:]
        assert len(index_rows(d.workdir / "nvme")) == before["chunks"]
        # the daemon keeps serving: the newest chunks from the arena, byte-exact
        recent = [i for i in during if raw.lookup([cs.keys[i]]) == [Tier.CPU]]
        assert len(recent) == t["cpu"]["chunks"] > 0
        assert cs.load(client, recent, "from the arena under ENOSPC") == [True] * len(recent)
        # what was demoted before the fault still reads fine (reads are not faulted)
        older = [i for i in first if raw.lookup([cs.keys[i]]) == [Tier.NVME]]
        assert older and cs.load(client, older, "from NVMe under ENOSPC") == [True] * len(older)
        # chunks whose demotion failed are misses, never wrong bytes
        lost = [i for i in during if i not in recent]
        assert lost and cs.load(client, lost, "dropped by ENOSPC") == [False] * len(lost)
        d.check()

        # fault cleared: demotions work again
        write_faults(faults, None)
        demotions = metric(d.metrics_text(), "kvtierd_demotions_total")
        assert cs.store(client, after) == [True] * len(after)
        wait_settled(d)
        assert metric(d.metrics_text(), "kvtierd_demotions_total") > demotions
        where = split_tiers(raw, [cs.keys[i] for i in after])
        demoted = [cs.keys.index(k) for k in where.get(Tier.NVME, [])]
        assert len(demoted) >= 3, where
        assert cs.load(client, after, "after the fault") == [True] * len(after)

        # EIO on reads: those chunks are misses (blocks stay poisoned), dropped, counted
        wait_settled(d)
        on_nvme = [i for i in range(len(cs)) if raw.lookup([cs.keys[i]]) == [Tier.NVME]]
        assert len(on_nvme) >= 3
        eio_before = metric(d.metrics_text(), "kvtierd_io_failures_total", tier="nvme",
                            reason="eio")
        write_faults(faults, {"read": "EIO"})
        assert cs.load(client, on_nvme, "under EIO") == [False] * len(on_nvme)
        write_faults(faults, None)
        m = d.metrics_text()
        assert metric(m, "kvtierd_io_failures_total", tier="nvme", reason="eio") - eio_before \
            == len(on_nvme)
        assert raw.lookup([cs.keys[i] for i in on_nvme]) == [Tier.NONE] * len(on_nvme)
        assert cs.load(client, on_nvme, "after EIO, fault cleared") == [False] * len(on_nvme)
        wait_settled(d)
        rows = index_rows(d.workdir / "nvme")
        assert not {cs.keys[i] for i in on_nvme} & {key for (_, _, key) in rows}
        assert d.alive()
    d.check()


def test_sync_eio_fails_the_demotion_and_indexes_nothing(daemon_factory, tmp_path):
    faults = tmp_path / "faults.json"
    write_faults(faults, {"sync": "EIO"})
    d = daemon_factory("--config", str(fault_config(tmp_path / "cfg", faults)),
                       cpu_bytes=SMALL_CPU)
    with InlineSession(d.address) as s:
        nbytes = 1024**2 - 321
        keys = [b"sync-%d" % i for i in range(10)]
        for key in keys:
            assert s.put({key: payload(key, nbytes)}) == [Status.OK]
        t = wait_settled(d)
        assert t["nvme"]["chunks"] == 0 and t["nvme"]["used_bytes"] == 0, t
        assert index_rows(d.workdir / "nvme") == {}
        assert metric(d.metrics_text(), "kvtierd_io_failures_total", tier="nvme",
                      reason="eio") > 0
        where = split_tiers(s, keys)
        assert set(where) <= {Tier.NONE, Tier.CPU} and where[Tier.CPU]
        results, frames, _ = s.get({k: nbytes for k in where[Tier.CPU]})
        assert results == [Status.OK] * len(where[Tier.CPU])
        assert [bytes(f) for f in frames] == [payload(k, nbytes) for k in where[Tier.CPU]]
    d.check()


# -- (e) NVMe full ---------------------------------------------------------------------------------

def fill_small_nvme(daemon_factory, n: int):
    d = daemon_factory(cpu_bytes=SMALL_CPU, nvme_bytes="8MiB")  # ~7 chunks of 17 pages
    layout = nvme_layout("nvme-full")
    cs = ChunkSet(layout, n, seed=5)
    return d, layout, cs


def test_full_nvme_tier_evicts_and_never_serves_wrong_bytes(daemon_factory):
    d, layout, cs = fill_small_nvme(daemon_factory, 30)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client, \
            cs.raw(d.address) as raw:
        for i in range(len(cs)):  # one PUT each: demotions happen in store order
            assert cs.store(client, [i]) == [True]
        t = wait_settled(d)
        nvme = t["nvme"]
        assert nvme["used_bytes"] <= nvme["capacity_bytes"] == 8 * 1024**2
        # (how many stay is test_full_nvme_tier_keeps_the_most_recently_demoted_chunks's business:
        # with that bug a burst of demotions can even leave the tier empty)
        assert nvme["chunks"] <= 7 and nvme.get("evictions", 0) > 0, t
        assert metric(d.metrics_text(), "kvtierd_evictions_total", tier="nvme") == \
            nvme["evictions"]
        rows = index_rows(d.workdir / "nvme")
        assert len(rows) == nvme["chunks"] and nvme_pages(rows) == nvme["used_bytes"]
        where = split_tiers(raw, cs.keys)
        assert len(where.get(Tier.NVME, [])) == nvme["chunks"]
        # Loading churns both full tiers (each promotion pushes an arena chunk down, which pushes
        # an NVMe chunk out), so not every resident chunk hits; every hit is byte-exact and every
        # miss leaves its blocks poisoned.
        hits = cs.load(client, what="full NVMe")
        assert any(hits)
        resident = set(where.get(Tier.NVME, [])) | set(where.get(Tier.CPU, []))
        assert {cs.keys[i] for i, hit in enumerate(hits) if hit} <= resident
        assert metric(d.metrics_text(), "kvtierd_integrity_failures_total") == 0
        # the tier keeps working after the churn
        assert any(cs.load(client, what="again"))
        t = wait_settled(d)
        assert t["nvme"]["used_bytes"] <= t["nvme"]["capacity_bytes"]
        assert nvme_pages(index_rows(d.workdir / "nvme")) == t["nvme"]["used_bytes"]
    d.check()


def test_full_nvme_tier_keeps_the_most_recently_demoted_chunks(daemon_factory):
    d, layout, cs = fill_small_nvme(daemon_factory, 30)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client, \
            cs.raw(d.address) as raw:
        for i in range(len(cs)):
            assert cs.store(client, [i]) == [True]
        t = wait_settled(d)
        where = split_tiers(raw, cs.keys)
        in_cpu = set(where.get(Tier.CPU, []))
        demoted_order = [k for k in cs.keys if k not in in_cpu]  # demoted oldest first
        newest = demoted_order[-6:]  # 7 fit; the newest 6 must all be there under LRU
        assert [k for k in newest if k in set(where.get(Tier.NVME, []))] == newest, (
            f"LRU kept {[cs.keys.index(k) for k in where.get(Tier.NVME, [])]}, lost "
            f"{[cs.keys.index(k) for k in newest if k not in set(where.get(Tier.NVME, []))]}")
        assert metric(d.metrics_text(), "kvtierd_io_failures_total", reason="no_space") == 0, t
    d.check()


# -- (f) stats, no tier, the directory lock --------------------------------------------------------

def test_stats_table_shows_the_nvme_tier(daemon_factory):
    d = daemon_factory(cpu_bytes=SMALL_CPU)
    with InlineSession(d.address) as s:
        for i in range(6):
            assert s.put({b"s%d" % i: payload(i, 1024**2)}) == [Status.OK]
    nvme = wait_settled(d)["nvme"]
    assert nvme["chunks"] > 0 and nvme["direct_io"] in (0, 1)
    out = subprocess.run([sys.executable, "-m", "kvtierd", "stats", "--socket", d.address],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["tier", "capacity"])
    table = {}
    for line in lines[header + 1:]:  # the tier table: up to the first blank line
        if not line.strip():
            break
        table[line.split()[0]] = line.split()
    assert set(table) == {"cpu", "nvme"}, out.stdout
    assert " ".join(table["nvme"][1:3]) == "256.0 MiB", out.stdout  # capacity
    assert table["nvme"][6] == str(nvme["chunks"]), out.stdout
    out = subprocess.run([sys.executable, "-m", "kvtierd", "stats", "--json", "--socket",
                          d.address], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["tiers"]["nvme"]
    assert got["capacity_bytes"] == 256 * 1024**2 and got["chunks"] == nvme["chunks"]
    assert "direct_io" in got
    d.check()


def test_nvme_bytes_zero_means_no_nvme_tier(daemon_factory):
    d = daemon_factory(cpu_bytes=SMALL_CPU, nvme_bytes="0")
    assert set(tiers(d)) == {"cpu"}
    with InlineSession(d.address) as s:
        keys = [b"z%d" % i for i in range(8)]
        for key in keys:
            assert s.put({key: payload(key, 1024**2)}) == [Status.OK]
        where = split_tiers(s, keys)
        assert set(where) == {Tier.NONE, Tier.CPU}  # evicted, not demoted
    m = d.metrics_text()
    assert 'tier="nvme"' not in m and "kvtierd_nvme_direct_io" not in m
    assert not (d.workdir / "nvme").exists()
    d.check()


def test_second_daemon_on_the_same_nvme_dir_refuses_to_start(daemon_factory, tmp_path):
    d = daemon_factory(cpu_bytes=SMALL_CPU)
    with InlineSession(d.address) as s:
        for i in range(6):
            assert s.put({b"lock%d" % i: payload(i, 1024**2)}) == [Status.OK]
    chunks = wait_settled(d)["nvme"]["chunks"]
    other = DaemonProcess(tmp_path / "other", ["--nvme-dir", str(d.workdir / "nvme")],
                          cpu_bytes=SMALL_CPU)
    with pytest.raises(RuntimeError, match="exited with 1"):
        other.start()
    other._log.close()
    log = other.log()
    assert "in use" in log and str(d.workdir / "nvme") in log, log
    assert "Traceback" not in log, log
    assert other.shm_files() == [], "the refused daemon left its arena behind"
    assert not (tmp_path / "other" / "kvtierd.sock").exists()
    # the first daemon is untouched
    assert tiers(d)["nvme"]["chunks"] == chunks
    assert len(index_rows(d.workdir / "nvme")) == chunks
    d.check()
