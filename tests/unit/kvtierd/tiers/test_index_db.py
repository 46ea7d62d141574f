"""ChunkIndexDB: the crash-safe SQLite (WAL) index of a tier, on real files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers.index_schema3 import write_schema_3

from kvtierd.tiers import index_format
from kvtierd.tiers.index_db import SCHEMA_VERSION, ChunkIndexDB, IndexRow, pack_runs, unpack_runs

META = {"page_bytes": "4096", "nvme_bytes": "1048576"}


def row(key: bytes, runs=((0, 1),), *, ns: str = "ns", rank: int = 0, fp: str = "fp",
        nbytes: int | None = None, tenant: str = "uid:1000") -> IndexRow:
    runs = [tuple(r) for r in runs]
    pages = sum(c for _, c in runs)
    return IndexRow(tenant, ns, rank, key, fp, nbytes if nbytes is not None else pages * 4096 - 7,
                    os.urandom(16), runs)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "index.sqlite"


def all_rows(db: ChunkIndexDB) -> dict:
    return {r.ikey: r for r in db.rows()}


# -- runs encoding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("runs", [[], [(0, 1)], [(5, 3), (0, 2), (9, 1)], [(2**40 + 3, 2**33)],
                                  [(2**64 - 2, 1)]])
def test_pack_unpack_runs_round_trip(runs):
    blob = pack_runs(runs)
    assert len(blob) == 16 * len(runs)
    assert blob == b"".join(struct.pack("<QQ", s, c) for s, c in runs)  # little-endian u64 pairs
    assert [tuple(r) for r in unpack_runs(blob)] == runs


def test_packed_runs_are_little_endian_u64_pairs():
    assert pack_runs([(1, 2)]) == bytes([1] + [0] * 7 + [2] + [0] * 7)
    assert unpack_runs(bytes([0, 1] + [0] * 6 + [3] + [0] * 7)) == [(256, 3)]


# -- rows ------------------------------------------------------------------------------------------

def test_insert_rows_delete_round_trip(path):
    db = ChunkIndexDB(path, META)
    assert db.reset_reason == "" and db.count() == 0 and list(db.rows()) == []
    a, b = row(b"a", [(0, 2)]), row(b"\x00\xffbin", [(7, 1), (3, 2)], ns="other", rank=3)
    c = row(b"a", [(9, 1)], rank=1)  # same key, other rank: another chunk
    d = row(b"a", [(11, 1)], tenant="team-b")  # same key and space, other tenant: another chunk
    db.insert([a, b])
    db.insert([c, d])
    assert db.count() == 4
    got = all_rows(db)
    assert got == {a.ikey: a, b.ikey: b, c.ikey: c, d.ikey: d}
    assert a.ikey == (("uid:1000", "ns", 0), b"a") and d.ikey[0][0] == "team-b"
    db.delete([d.ikey])
    assert got[b.ikey].runs == [(7, 1), (3, 2)]  # payload order, not sorted
    assert isinstance(got[b.ikey].key, bytes) and isinstance(got[b.ikey].checksum, bytes)
    db.delete([a.ikey, (("t", "nope", 0), b"x")])  # an absent key is no error
    assert all_rows(db) == {b.ikey: b, c.ikey: c}
    db.close()
    db = ChunkIndexDB(path, META)  # and it is all on disk
    assert all_rows(db) == {b.ikey: b, c.ikey: c}
    db.close()


def test_insert_replaces_a_row_with_the_same_key(path):
    db = ChunkIndexDB(path, META)
    old, new = row(b"k", [(0, 1)]), row(b"k", [(4, 2)], fp="fp2")
    db.insert([old])
    db.insert([new])
    assert db.count() == 1 and all_rows(db)[new.ikey] == new
    db.close()


def test_rows_iterates_every_row_in_batches(path):
    db = ChunkIndexDB(path, META)
    assert db.rows_written() == 0
    rows = [row(b"k%03d" % i, [(i, 1)]) for i in range(25)]
    db.insert(rows)
    assert sorted(r.key for r in db.rows(batch=4)) == sorted(r.key for r in rows)
    db.delete([rows[3].ikey])
    assert db.count() == 24 and db.rows_written() >= 24  # an upper bound, never a scan
    db.close()


def test_index_is_in_wal_mode(path):
    ChunkIndexDB(path, META).close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert dict(conn.execute("SELECT k, v FROM meta")) == {"schema": str(SCHEMA_VERSION),
                                                               **META}
    finally:
        conn.close()


def test_insert_from_another_thread(path):
    db = ChunkIndexDB(path, META)  # I/O threads insert; the loop thread reads at start-up
    rows = [row(b"t%d" % i, [(i, 1)]) for i in range(8)]
    threads = [threading.Thread(target=db.insert, args=([r],)) for r in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert db.count() == 8
    db.close()


# -- meta ------------------------------------------------------------------------------------------

def test_same_meta_keeps_the_rows(path):
    db = ChunkIndexDB(path, META)
    db.insert([row(b"kept")])
    db.close()
    db = ChunkIndexDB(path, dict(META))
    assert db.reset_reason == "" and db.count() == 1
    db.close()


def test_changed_meta_resets_the_index_and_says_why(path):
    db = ChunkIndexDB(path, META)
    db.insert([row(b"a"), row(b"b", [(1, 1)])])
    db.close()
    db = ChunkIndexDB(path, {**META, "page_bytes": "8192"})
    assert db.count() == 0
    assert "page_bytes" in db.reset_reason and "4096" in db.reset_reason \
        and "8192" in db.reset_reason
    assert "nvme_bytes" not in db.reset_reason
    db.insert([row(b"c")])
    db.close()
    db = ChunkIndexDB(path, {**META, "page_bytes": "8192"})  # the new meta was recorded
    assert db.reset_reason == "" and db.count() == 1
    db.close()


def test_new_meta_key_resets_too(path):
    ChunkIndexDB(path, META).close()
    db = ChunkIndexDB(path, {**META, "extra": "1"})
    assert "extra" in db.reset_reason
    db.close()


# -- crash safety ----------------------------------------------------------------------------------

CRASHER = """
import os, signal, sys
from pathlib import Path
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow
db = ChunkIndexDB(Path(sys.argv[1]), {"page_bytes": "4096", "nvme_bytes": "1048576"})
db.insert([IndexRow("uid:0", "ns", 0, b"durable", "fp", 4000, b"c" * 16, [(3, 1)])])
if sys.argv[2] == "exit":
    os._exit(0)  # no close, no checkpoint, no atexit
print("inserted", flush=True)
sys.stdin.read()  # wait for SIGKILL
"""


@pytest.mark.parametrize("how", ["os._exit", "kill -9"])
def test_committed_row_survives_the_process_dying(path, how):
    code = textwrap.dedent(CRASHER)
    if how == "os._exit":
        done = subprocess.run([sys.executable, "-c", code, str(path), "exit"], timeout=60)
        assert done.returncode == 0
    else:
        proc = subprocess.Popen([sys.executable, "-c", code, str(path), "wait"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "inserted"
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()
    db = ChunkIndexDB(path, META)
    assert db.reset_reason == ""
    rows = list(db.rows())
    assert [(r.key, r.runs, r.nbytes, r.checksum) for r in rows] == \
        [(b"durable", [(3, 1)], 4000, b"c" * 16)]
    db.close()


# -- transactions ----------------------------------------------------------------------------------

def _still_writable(db: ChunkIndexDB) -> None:
    """The connection is out of any transaction: insert and delete work, nothing half-written."""
    assert not db._db.in_transaction
    ok = row(b"after", [(40, 1)])
    db.insert([ok])
    assert all_rows(db)[ok.ikey] == ok
    db.delete([ok.ikey])
    assert ok.ikey not in all_rows(db)


def test_regression_unbindable_rank_rolls_back_and_the_next_write_works(path):
    """The HELLO rank = 2**63 attack: sqlite3 raised OverflowError after BEGIN and the connection
    stayed inside the transaction, so every later write failed for every namespace."""
    db = ChunkIndexDB(path, META)
    kept = row(b"kept", [(1, 1)])
    db.insert([kept])
    with pytest.raises(OverflowError):
        db.insert([row(b"first", [(2, 1)]), row(b"huge", [(3, 1)], rank=2**63)])
    assert all_rows(db) == {kept.ikey: kept}  # the row before the bad one was rolled back
    _still_writable(db)
    with pytest.raises(OverflowError):
        db.delete([kept.ikey, (("t", "ns", 2**63), b"k")])
    assert all_rows(db) == {kept.ikey: kept}  # the delete before the bad key was rolled back
    _still_writable(db)
    db.close()


def test_exception_from_the_rows_iterator_rolls_back(path):
    db = ChunkIndexDB(path, META)
    good = [row(b"g%d" % i, [(i, 1)]) for i in range(3)]

    def rows_then_fail():
        yield from good
        raise RuntimeError("injected mid-transaction")

    with pytest.raises(RuntimeError, match="injected"):
        db.insert(rows_then_fail())
    assert db.count() == 0
    _still_writable(db)

    def keys_then_fail():
        yield good[0].ikey
        raise KeyError("injected")

    db.insert(good)
    with pytest.raises(KeyError):
        db.delete(keys_then_fail())
    assert db.count() == 3  # the first delete was rolled back
    _still_writable(db)
    db.close()


# -- schema and files ------------------------------------------------------------------------------

def test_schema_1_index_is_reset_with_its_reason(path):
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
    old.execute("CREATE TABLE chunks (namespace TEXT NOT NULL, rank INTEGER NOT NULL, key BLOB NOT"
                " NULL, fingerprint TEXT NOT NULL, nbytes INTEGER NOT NULL, checksum BLOB NOT NULL,"
                " runs BLOB NOT NULL, PRIMARY KEY (namespace, rank, key))")
    old.executemany("INSERT INTO meta VALUES (?, ?)", {"schema": "1", **META}.items())
    old.execute("INSERT INTO chunks VALUES ('ns', 0, x'01', 'fp', 10, x'00', x'')")
    old.commit()
    old.close()
    db = ChunkIndexDB(path, META)
    assert f"schema: '1' -> '{SCHEMA_VERSION}'" in db.reset_reason
    assert db.count() == 0
    new = row(b"new")
    db.insert([new])  # the table has the tenant column now
    assert all_rows(db) == {new.ikey: new}
    db.close()


SCHEMA_2_CHUNKS = (
    "CREATE TABLE chunks (tenant TEXT NOT NULL, namespace TEXT NOT NULL, rank INTEGER NOT NULL,"
    " key BLOB NOT NULL, fingerprint TEXT NOT NULL, nbytes INTEGER NOT NULL, checksum BLOB NOT"
    " NULL, runs BLOB NOT NULL, PRIMARY KEY (tenant, namespace, rank, key))")


def schema_2_file(path, rows: list[IndexRow], meta=META) -> None:
    """An index as a schema-2 daemon wrote it (its DDL, one row per INSERT OR REPLACE)."""
    old = sqlite3.connect(path)
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
    old.execute(SCHEMA_2_CHUNKS)
    old.executemany("INSERT INTO meta VALUES (?, ?)", {"schema": "2", **meta}.items())
    for r in rows:
        old.execute("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.tenant, r.namespace, r.rank, r.key, r.fingerprint, r.nbytes, r.checksum,
                     pack_runs(r.runs)))
    old.commit()
    old.close()


def test_schema_2_index_is_migrated_keeping_rows_and_their_order(path, caplog):
    rows = [row(b"k%02d" % i, [(i * 3, 1 + i % 3)], ns=f"ns{i % 2}", rank=i % 3,
                tenant=f"uid:{1000 + i % 2}", fp=f"fp{i % 4}") for i in range(30)]
    # rewritten last:
    rows[5] = row(b"k05", [(200, 1)], ns="ns1", rank=2, tenant="uid:1001", fp="fp1")
    schema_2_file(path, rows[:5] + rows[6:] + [rows[5]])
    with caplog.at_level(logging.INFO, logger="kvtierd.tiers.index_db"):
        db = ChunkIndexDB(path, META)
    assert db.reset_reason == ""
    assert f"migrated from schema 2 to {SCHEMA_VERSION} (30 rows)" in caplog.text
    assert all_rows(db) == {r.ikey: r for r in rows}
    spaces, fps = db.space_names(), db.fingerprint_names()
    stored = [(spaces[s], key, fps[index_format.unpack(packed)[0]])
              for batch in db.row_batches(batch=7) for s, key, packed in batch]
    order = rows[:5] + rows[6:] + [rows[5]]
    assert stored == [((r.tenant, r.namespace, r.rank), r.key, r.fingerprint) for r in order]
    assert len(spaces) == len({r.ikey[0] for r in rows}) and len(fps) == 4  # each stored once
    db.delete([rows[0].ikey])
    db.insert([row(b"new", [(250, 1)])])
    db.close()
    db = ChunkIndexDB(path, META)  # the migrated file opens as it is
    assert db.reset_reason == "" and db.count() == 30
    db.close()


def test_schema_2_index_with_other_meta_is_reset_not_migrated(path):
    schema_2_file(path, [row(b"a")])
    db = ChunkIndexDB(path, {**META, "page_bytes": "8192"})
    assert "page_bytes: '4096' -> '8192'" in db.reset_reason and (
        f"schema: '2' -> '{SCHEMA_VERSION}'" in db.reset_reason)
    assert db.count() == 0
    db.insert([row(b"b")])
    assert [r.key for r in db.rows()] == [b"b"]
    db.close()


def test_failed_insert_leaves_no_id_behind(path):
    """A new space or fingerprint made by a transaction that rolled back must not be cached:
    a later row would name an id the file does not have."""
    db = ChunkIndexDB(path, META)
    first = row(b"first", tenant="uid:7", ns="fresh", fp="new-fp")

    def then_fail():
        yield first
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError):
        db.insert(then_fail())
    assert db.space_names() == {} and db.fingerprint_names() == {}
    again = row(b"again", tenant="uid:7", ns="fresh", fp="new-fp")
    db.insert([again])
    assert all_rows(db) == {again.ikey: again}
    db.delete([again.ikey, (("uid:8", "never", 0), b"k")])  # an unknown space: nothing to delete
    assert db.count() == 0
    db.close()


def test_index_files_are_0600_whatever_the_umask(path):
    before = os.umask(0o000)
    try:
        db = ChunkIndexDB(path, META)
        db.insert([row(b"k")])
        files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
        assert all(f.exists() for f in files)
        assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == \
            {f.name: "0o600" for f in files}
        db.close()
        path.chmod(0o644)  # an index of an older version: narrowed on open
        ChunkIndexDB(path, META).close()
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(before)


# -- schema 3 -> 4 ---------------------------------------------------------------------------------

DATA = Path(__file__).resolve().parents[3] / "data"


def view_rows(path) -> list[tuple]:
    """The ``chunks`` view as an operator's sqlite3 shell reads it (no function of ours)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sorted(conn.execute("SELECT tenant, namespace, rank, key, fingerprint, nbytes,"
                                   " checksum, runs FROM chunks").fetchall())
    finally:
        conn.close()


def stored_order(db: ChunkIndexDB) -> list[tuple]:
    spaces = db.space_names()
    return [(spaces[s], bytes(key)) for batch in db.row_batches(batch=7) for s, key, _ in batch]


def test_schema_3_file_written_by_the_schema_3_code_is_migrated_with_every_row(tmp_path, caplog):
    """tests/data/index_schema3.sqlite was written by schema 3's ChunkIndexDB itself (rows from
    two transactions, one deleted, one rewritten last, a multi-run row, a row recovery drops)."""
    expected = json.loads((DATA / "index_schema3.json").read_text())
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "index_schema3.sqlite", path)
    rows = [IndexRow(r["tenant"], r["namespace"], r["rank"], bytes.fromhex(r["key"]),
                     r["fingerprint"], r["nbytes"], bytes.fromhex(r["checksum"]),
                     [tuple(run) for run in r["runs"]]) for r in expected["rows"]]
    with caplog.at_level(logging.INFO, logger="kvtierd.tiers.index_db"):
        db = ChunkIndexDB(path, expected["meta"])
    assert db.reset_reason == ""
    assert f"migrated from schema 3 to {SCHEMA_VERSION} ({len(rows)} rows)" in caplog.text
    assert list(db.rows()) == rows  # every field byte for byte, in the order written
    assert stored_order(db) == [r.ikey for r in rows]
    db.close()
    assert view_rows(path) == sorted((r.tenant, r.namespace, r.rank, r.key, r.fingerprint,
                                      r.nbytes, r.checksum, pack_runs(r.runs)) for r in rows)


def test_schema_3_index_is_migrated_keeping_rows_order_and_the_chunks_view(path, caplog):
    rows = [row(os.urandom(1 + i), [(i * 4, 1 + i % 3)] if i % 5 else [(i * 4, 1), (i * 4 + 2, 1)],
                ns=f"ns{i % 2}", rank=i % 3, tenant=f"uid:{1000 + i % 2}", fp=f"fp{i % 4}")
            for i in range(60)]
    odd = IndexRow("uid:1000", "ns0", 0, b"odd", "fp0", 2**63 - 1, os.urandom(7), [])
    rows[9] = IndexRow(*rows[9].ikey[0], rows[9].key, "fp1", 100, os.urandom(16), [(300, 1)])
    order = rows[:9] + rows[10:] + [odd, rows[9]]  # row 9 rewritten last
    write_schema_3(path, rows[:9] + [row(rows[9].key, [(301, 1)], ns=rows[9].namespace,
                                         rank=rows[9].rank, tenant=rows[9].tenant)]
                   + rows[10:] + [odd, rows[9]], META)
    before = view_rows(path)
    with caplog.at_level(logging.INFO, logger="kvtierd.tiers.index_db"):
        db = ChunkIndexDB(path, META)
    assert db.reset_reason == "" and "migrated from schema 3" in caplog.text
    assert os.path.getsize(f"{path}-wal") == 0  # compacted: the WAL gave its space back
    assert list(db.rows()) == order
    assert stored_order(db) == [r.ikey for r in order]
    db.close()
    assert view_rows(path) == before  # the view reads as it did
    conn = sqlite3.connect(path)
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert "entries_v3" not in tables and "packed" in {
        c[1] for c in conn.execute("PRAGMA table_info(entries)")}
    conn.close()
    db = ChunkIndexDB(path, META)  # the migrated file opens as it is, and takes writes
    assert db.reset_reason == "" and db.count() == len(order)
    db.delete([order[0].ikey])
    db.insert([row(b"new", [(500, 1)])])
    assert db.count() == len(order)
    db.close()


def test_schema_3_file_with_tables_of_another_shape_is_reset_with_the_reason(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
    conn.executemany("INSERT INTO meta VALUES (?, ?)", {"schema": "3", **META}.items())
    conn.execute("CREATE TABLE entries (space INTEGER, key BLOB)")  # damaged: no other column
    conn.execute("INSERT INTO entries VALUES (1, x'01')")
    conn.commit()
    conn.close()
    db = ChunkIndexDB(path, META)
    assert "migration from schema 3 failed" in db.reset_reason, db.reset_reason
    assert db.count() == 0
    new = row(b"new")
    db.insert([new])
    assert all_rows(db) == {new.ikey: new}
    db.close()
