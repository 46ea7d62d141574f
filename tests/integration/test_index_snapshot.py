"""Restart from the index snapshot of a clean stop, through real daemons: a clean stop →
start is served from the snapshot (both tiers), every chunk byte-exact and the LRU order kept;
after SIGKILL, or with a damaged, truncated, foreign-geometry or stale snapshot, or after an
offline write to the index, the start reads the rows (reason logged) and loses nothing."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
from helpers.bad_input import POISON, Session, names
from helpers.nvme import sigterm, wait_settled

from kvtierd.protocol import Op, Tier
from kvtierd.tiers import index_snapshot
from kvtierd.tiers.index_db import SNAPSHOT_KEY, ChunkIndexDB

pytestmark = pytest.mark.timeout(120)

PAGE = 16 * 1024
TIER_PAGES = 64  # one-page chunks: eviction starts above 95 % (60 chunks)


class Chunks:
    """Random one-page chunks at fixed staging offsets, put and read back byte for byte."""

    def __init__(self, memfd, count: int, seed: int) -> None:
        rng = random.Random(seed)
        self.keys = [rng.randbytes(32) for _ in range(count)]
        self.where = {k: i for i, k in enumerate(self.keys)}
        self.memfd, self.nbytes = memfd, count * PAGE
        self.payload = rng.randbytes(count * PAGE)
        self.buf = None

    def session(self, d) -> Session:
        """A session with a staging buffer of its own holding the payload (protocol 3: the
        daemon seals a handed-over memfd, which no later session can map writable)."""
        self.buf = self.memfd(self.nbytes)
        self.buf.write(0, self.payload)
        return Session(d.address, "snap", staging=self.buf)

    def items(self, keys):
        return [[k, self.where[k] * PAGE, PAGE] for k in keys]

    def put(self, s: Session, keys) -> None:
        assert names(s.put(self.items(keys))["results"]) == ["OK"] * len(keys)

    def get_exact(self, s: Session, keys) -> None:
        """GET ``keys`` in this order (touching them in it) into poisoned staging: byte-exact.
        """
        self.buf.fill(POISON, 0, len(self.keys) * PAGE)
        reply, _ = s.get(self.items(keys))
        assert names(reply["results"]) == ["OK"] * len(keys)
        for key in keys:
            off = self.where[key] * PAGE
            assert self.buf.read(off, PAGE) == self.payload[off:off + PAGE], key
        self.buf.write(0, self.payload)  # the staging is the source of later PUTs again


def arena_index(d) -> Path:
    return Path(f"/dev/shm/{d.arena_name}.index")


def starts_since(d, mark: int) -> str:
    return d.log()[mark:]


def stop_start(d) -> str:
    """SIGTERM (clean), start again; the log of the new start."""
    sigterm(d)
    mark = len(d.log())
    d.restart()
    return starts_since(d, mark)


def test_clean_restart_serves_from_the_snapshot_in_lru_order(daemon_factory, memfd):
    d = daemon_factory("--cpu-persistent", cpu_bytes=str(TIER_PAGES * PAGE),
                       page_bytes=str(PAGE), nvme_bytes="0")
    cs = Chunks(memfd, 70, seed=21)
    first, later = cs.keys[:40], cs.keys[40:]
    rng = random.Random(22)
    s = cs.session(d)
    cs.put(s, first)
    model = list(first)  # coldest first
    for _ in range(10):
        batch = [rng.choice(first) for _ in range(rng.randint(1, 20))]
        assert s.lookup(batch) == [Tier.CPU] * len(batch)
        for key in batch:
            model.remove(key)
            model.append(key)
    s.close()
    log = stop_start(d)
    assert "snapshot of 40 chunks" in d.log()
    assert f"cpu index {arena_index(d)}: 40 chunks from snapshot" in log, log
    assert not index_snapshot.path_for(arena_index(d)).exists(), "a used snapshot is deleted"
    d.check()
    s = cs.session(d)
    # Evictions, coldest first, before any read (a read would touch chunks into a new order):
    # the survivors must be exactly the warmest by the order before the stop.
    for key in later:
        cs.put(s, [key])
        model.append(key)
    assert d.cpu()["evictions"] > 0
    alive = [t == Tier.CPU for t in s.lookup(model)]
    survivors = alive.index(True)
    assert 0 < survivors and all(alive[survivors:]), (
        "after a restart from the snapshot, a chunk colder than a survivor outlived it", alive)
    cs.get_exact(s, model[survivors:])
    s.close()


def test_sigkill_after_a_snapshot_start_reads_the_rows(daemon_factory, memfd):
    """Both tiers (warm arena, NVMe written through) from their snapshots; then PUTs and DELETEs
    and kill -9: the next start must read the rows (the snapshot is gone and its token too), and
    deleted chunks stay deleted."""
    d = daemon_factory("--cpu-persistent", "--nvme-write-policy", "write-through",
                       cpu_bytes=str(TIER_PAGES * PAGE), page_bytes=str(PAGE),
                       nvme_bytes="4MiB")
    cs = Chunks(memfd, 50, seed=23)
    s = cs.session(d)
    cs.put(s, cs.keys[:30])
    s.close()
    wait_settled(d)
    log = stop_start(d)
    assert "cpu index" in log and "30 chunks from snapshot" in log, log
    assert "30 chunks recovered from snapshot" in log, log  # the NVMe tier's line
    s = cs.session(d)
    cs.get_exact(s, cs.keys[:30])
    cs.put(s, cs.keys[30:])
    gone = cs.keys[5:15]
    reply, _ = s.request(Op.DELETE, keys=gone)
    assert reply["name"] == "OK", reply
    s.close()
    wait_settled(d)
    db = sqlite3.connect(arena_index(d))
    assert not db.execute("SELECT v FROM meta WHERE k = ?", (SNAPSHOT_KEY,)).fetchall()
    db.close()
    d.kill9()
    mark = len(d.log())
    d.restart()
    log = starts_since(d, mark)
    assert "from snapshot" not in log and "40 chunks from rows" in log, log
    assert "snapshot not used (no snapshot)" in log
    s = cs.session(d)
    kept = [k for k in cs.keys if k not in gone]
    assert s.lookup(gone) == [Tier.NONE] * len(gone)
    assert Tier.NONE not in s.lookup(kept)
    cs.get_exact(s, kept)
    s.close()
    d.check()


def _corrupt(case: str, path: Path, db_path: Path) -> None:
    data = path.read_bytes()
    if case == "flipped":
        pos = len(data) // 2
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1:])
    elif case == "truncated":
        path.write_bytes(data[:len(data) - 100])
    elif case == "token":
        db = sqlite3.connect(db_path)
        db.execute("UPDATE meta SET v = 'not-the-token' WHERE k = ?", (SNAPSHOT_KEY,))
        db.commit()
        db.close()
    elif case == "geometry":  # a sound snapshot, with the token, but of another page size
        db = sqlite3.connect(db_path)
        meta = dict(db.execute("SELECT k, v FROM meta"))
        db.close()
        token = meta.pop(SNAPSHOT_KEY)
        num_pages = TIER_PAGES
        snap = index_snapshot.read(path, token=token, meta=meta, num_pages=num_pages)
        index_snapshot.write(path, meta={**meta, "page_bytes": str(2 * PAGE)},
                             num_pages=num_pages, token=token, columns=snap.columns,
                             page_map=snap.page_map, pages=snap.pages,
                             tenant_pages=snap.tenant_pages)
    else:
        raise AssertionError(case)


REASONS = {"flipped": "checksum mismatch", "truncated": "checksum mismatch", "token": "stale",
           "geometry": "another geometry"}


@pytest.mark.parametrize("case", sorted(REASONS))
def test_a_bad_snapshot_is_refused_and_the_rows_serve(daemon_factory, memfd, case):
    d = daemon_factory("--cpu-persistent", cpu_bytes=str(TIER_PAGES * PAGE),
                       page_bytes=str(PAGE), nvme_bytes="0")
    cs = Chunks(memfd, 20, seed=24)
    s = cs.session(d)
    cs.put(s, cs.keys)
    s.close()
    sigterm(d)
    snap = index_snapshot.path_for(arena_index(d))
    assert snap.exists()
    _corrupt(case, snap, arena_index(d))
    mark = len(d.log())
    d.restart()
    log = starts_since(d, mark)
    assert "WARNING" in log and REASONS[case] in log and "20 chunks from rows" in log, log
    assert not snap.exists()
    s = cs.session(d)
    cs.get_exact(s, cs.keys)
    s.close()


def test_an_offline_index_write_after_a_clean_stop_voids_the_snapshot(daemon_factory, memfd):
    d = daemon_factory("--cpu-persistent", cpu_bytes=str(TIER_PAGES * PAGE),
                       page_bytes=str(PAGE), nvme_bytes="0")
    cs = Chunks(memfd, 20, seed=25)
    s = cs.session(d)
    cs.put(s, cs.keys)
    tenant = s.hello.get("tenant")
    s.close()
    sigterm(d)
    assert index_snapshot.path_for(arena_index(d)).exists()
    db = ChunkIndexDB(arena_index(d), {"page_bytes": str(PAGE),
                                       "cpu_bytes": str(TIER_PAGES * PAGE)})
    assert db.snapshot_token and not db.reset_reason
    (row,) = [r for r in db.rows() if r.key == cs.keys[3]]
    assert tenant is None or row.tenant == tenant
    db.delete([row.ikey])  # an offline tool's write: the first write clears the token
    db.close()
    mark = len(d.log())
    d.restart()
    log = starts_since(d, mark)
    assert "stale" in log and "19 chunks from rows" in log, log
    s = cs.session(d)
    assert s.lookup([cs.keys[3]]) == [Tier.NONE]
    kept = cs.keys[:3] + cs.keys[4:]
    cs.get_exact(s, kept)
    s.close()



def test_without_index_snapshot_a_clean_stop_leaves_the_index_as_older_daemons_wrote_it(
        daemon_factory, memfd):
    """Rolling back: a daemon with ``--no-index-snapshot`` still starts from a snapshot, but its
    clean stop writes neither a snapshot nor a token, so the meta table holds exactly what a
    daemon without snapshots wrote and checks (it drops an index with any other key in meta);
    the next start reads the rows, every chunk byte-exact."""
    d = daemon_factory("--cpu-persistent", cpu_bytes=str(TIER_PAGES * PAGE),
                       page_bytes=str(PAGE), nvme_bytes="0")
    cs = Chunks(memfd, 20, seed=26)
    s = cs.session(d)
    cs.put(s, cs.keys)
    s.close()
    d.flags.append("--no-index-snapshot")
    assert "20 chunks from snapshot" in stop_start(d)  # written by the stop of a default daemon
    sigterm(d)
    assert "snapshot of" not in d.log().split("20 chunks from snapshot")[-1]
    assert not index_snapshot.path_for(arena_index(d)).exists()
    db = sqlite3.connect(arena_index(d))
    meta = dict(db.execute("SELECT k, v FROM meta"))
    db.close()
    assert set(meta) == {"schema", "page_bytes", "cpu_bytes"}, meta
    mark = len(d.log())
    d.restart()
    log = starts_since(d, mark)
    assert "20 chunks from rows" in log and "snapshot not used (no snapshot)" in log, log
    s = cs.session(d)
    cs.get_exact(s, cs.keys)
    s.close()
