"""A tier's crash-safe chunk index: SQLite in WAL mode (stdlib).

Why SQLite rather than our own append-only journal: atomic multi-row transactions, crash safety
and page reuse (no compaction pass) come with the standard library and are tested far beyond
what a hand-written journal would be; WAL keeps a commit to one sequential append plus an fsync.

Rule the tiers follow: a row is inserted only after the pages it names are durable, and a row is
deleted (committed) before its pages can be reused. So after a crash every row names a complete
chunk, and every page no row names is free. Checksums guard the remaining cases (bit rot, a page
changed behind our back): every read is verified before a byte reaches a client.

One connection, used by one thread at a time (the caller serialises; ``check_same_thread`` is off
so that the owning thread may be an I/O worker). Every write goes through ``_transaction``: BEGIN …
COMMIT, and ROLLBACK on any exception (a value SQLite cannot bind, a failing rows iterator, a full
disk), so the connection can never be left inside a transaction that poisons every later write.

Schema 2 adds the tenant to every row (part of the primary key): an index of schema 1 has no
tenant to give its chunks, so it is reset with the reason logged.

Schema 3 stores each key space ``(tenant, namespace, rank)`` and each layout fingerprint once, in
``spaces`` and ``fingerprints``, and a row (table ``entries``) names them by small integer ids.
Why: a restart reads every row, and Python's sqlite3 builds one object per column per row; three
strings per row were a third of a million-row recovery (1.25 -> 0.87 CPU-s per 1M rows here).

Schema 4 packs a row's fixed-size fields (fingerprint id, nbytes, checksum, runs) into one blob,
``packed`` (layout: ``index_format``), so a row is three columns (space, key, packed). Why: the
same per-column cost again; and a batch of packed blobs is decoded into the compact index's
columns in C-level passes (1.5 -> ~1.0 CPU-s per 1M rows for the fetch alone here).

The view ``chunks`` shows the rows with names and fields, as schema 2's table did (for operators
and tests; it decodes the blob in plain SQL). An index of schema 2 or 3 is migrated at open in one
transaction (logged; a few CPU-s per 1M rows, once), keeping every row and their order.

A clean stop may leave a snapshot of the index beside it (``index_restore``), named by a random
token in ``meta`` (key ``snapshot_token``, not part of what must match at open). Every write of
this class clears a present token in the same transaction, so a snapshot never outlives a
change of the rows it stands for, whoever makes the change (the daemon, an offline tool).

The files (the database and SQLite's ``-wal``/``-shm`` beside it) are 0600: they hold tenants,
namespaces and prefix hashes. SQLite gives the -wal/-shm files the database file's mode, so the
database file is created 0600 before SQLite opens it, and older files are narrowed to 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from kvtierd.tiers import index_format
from kvtierd.tiers.allocator import Run

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4
MIGRATES_FROM = ("2", "3")  # an index of these schemas is migrated at open; any other is reset
FILE_MODE = 0o600
# SQLite's page cache while migrating, at most (pages are taken as needed: ~260 MB per 1M rows).
MIGRATE_CACHE_KIB = 1 << 20
SIDE_FILES = ("-wal", "-shm")  # SQLite's WAL files next to the database
SNAPSHOT_KEY = "snapshot_token"  # meta: the token of the snapshot that stands for the rows

IKey = tuple[tuple[str, str, int], bytes]  # ((tenant, namespace, rank), key)
StoredKey = tuple[int, bytes]  # (space id, key): a row as stored (recovery deletes rows by it)
Space = tuple[str, str, int]

_NAMES = (
    "CREATE TABLE spaces (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, namespace TEXT NOT NULL,"
    " rank INTEGER NOT NULL, UNIQUE (tenant, namespace, rank))",
    "CREATE TABLE fingerprints (id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL UNIQUE)",
)
_FIELDS = index_format.view_fields("e.packed", "b.v")
_SCHEMA = (
    *_NAMES,
    "CREATE TABLE entries (space INTEGER NOT NULL, key BLOB NOT NULL, packed BLOB NOT NULL,"
    " PRIMARY KEY (space, key))",
    # The rows with names and fields, as schema 2's table had them (for operators and tests):
    # the packed fields decoded in plain SQL, so that the sqlite3 shell reads it too.
    "CREATE VIEW chunks AS SELECT s.tenant AS tenant, s.namespace AS namespace, s.rank AS rank,"
    " r.key AS key, f.fingerprint AS fingerprint, r.nbytes AS nbytes,"
    f" substr(r.packed, {index_format.HEAD.size + 1}, r.checksum_len) AS checksum,"
    f" substr(r.packed, {index_format.HEAD.size + 1} + r.checksum_len) AS runs"
    " FROM (SELECT e.space AS space, e.key AS key, e.packed AS packed,"
    f" {_FIELDS['fingerprint_id']} AS fingerprint_id, {_FIELDS['checksum_len']} AS checksum_len,"
    f" {_FIELDS['nbytes']} AS nbytes FROM entries e, (SELECT {index_format.BYTE_VALUES} AS v) b) r"
    " JOIN spaces s ON s.id = r.space JOIN fingerprints f ON f.id = r.fingerprint_id",
)
_SCHEMA_3 = (  # as schema 3 had it: the step between 2 and 4
    *_NAMES,
    "CREATE TABLE entries (space INTEGER NOT NULL, key BLOB NOT NULL, fingerprint INTEGER NOT NULL,"
    " nbytes INTEGER NOT NULL, checksum BLOB NOT NULL, runs BLOB NOT NULL,"
    " PRIMARY KEY (space, key))",
)
_MIGRATE = {
    "2": (
        "ALTER TABLE chunks RENAME TO chunks_v2",
        *_SCHEMA_3,
        "INSERT INTO spaces (tenant, namespace, rank) SELECT DISTINCT tenant, namespace, rank"
        " FROM chunks_v2",
        "INSERT INTO fingerprints (fingerprint) SELECT DISTINCT fingerprint FROM chunks_v2",
        "INSERT INTO entries SELECT s.id, c.key, f.id, c.nbytes, c.checksum, c.runs FROM chunks_v2"
        " c JOIN spaces s ON s.tenant = c.tenant AND s.namespace = c.namespace AND s.rank = c.rank"
        " JOIN fingerprints f ON f.fingerprint = c.fingerprint ORDER BY c.rowid",
        "DROP TABLE chunks_v2",
    ),
    "3": (
        "DROP VIEW IF EXISTS chunks",  # else the rename below would re-point it at entries_v3
        "ALTER TABLE entries RENAME TO entries_v3",
        *_SCHEMA[2:],
        "INSERT INTO entries SELECT space, key, kvtierd_pack(fingerprint, nbytes, checksum, runs)"
        " FROM entries_v3 ORDER BY rowid",
        "DROP TABLE entries_v3",
    ),
}


@dataclass(frozen=True)
class IndexRow:
    tenant: str
    namespace: str
    rank: int
    key: bytes
    fingerprint: str
    nbytes: int
    checksum: bytes
    runs: list[Run]

    @property
    def ikey(self) -> IKey:
        return ((self.tenant, self.namespace, self.rank), self.key)

    @classmethod
    def of(cls, ikey: IKey, fingerprint: str, nbytes: int, checksum: bytes, runs: list[Run]
           ) -> IndexRow:
        (tenant, namespace, rank), key = ikey
        return cls(tenant, namespace, rank, key, fingerprint, nbytes, checksum, runs)


_RUN = struct.Struct("<QQ")


def pack_runs(runs: list[Run]) -> bytes:
    if len(runs) == 1:
        return _RUN.pack(*runs[0])
    return b"".join(_RUN.pack(start, count) for start, count in runs)


def unpack_runs(blob: bytes) -> list[Run]:
    if len(blob) == _RUN.size:  # the common case, on the recovery path for every row
        return [_RUN.unpack(blob)]
    return list(_RUN.iter_unpack(blob))  # struct.error unless whole (start, count) pairs


class ChunkIndexDB:
    def __init__(self, path: Path, meta: dict[str, str], synchronous: str = "FULL") -> None:
        """Open (or create) the index at ``path``; ``meta`` must match what the file recorded,
        else the index is reset (the caller logs why) and ``self.reset_reason`` says so. An
        index of schema ``MIGRATES_FROM`` with the same meta is migrated, keeping its rows."""
        self.path = path
        self.lock = threading.Lock()
        self.reset_reason = ""
        _create_private(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
        wanted = {"schema": str(SCHEMA_VERSION), **meta}
        self.meta = wanted  # what a snapshot of this index must have been taken under
        stored = dict(self._db.execute("SELECT k, v FROM meta").fetchall())
        # A clean stop's snapshot token (``index_restore``): not part of what must match, and
        # cleared by the first write of this connection (or by the reset or migration below).
        self.snapshot_token = stored.pop(SNAPSHOT_KEY, "")
        if stored != wanted:
            schema = stored.get("schema", "")
            if schema in MIGRATES_FROM and {**stored, "schema": wanted["schema"]} == wanted:
                try:
                    self._migrate(schema)
                except sqlite3.DatabaseError as exc:  # tables that are not that schema's
                    self._reset(stored, wanted, f"migration from schema {schema} failed: {exc}")
            else:
                self._reset(stored, wanted)
        # Ids of the (few) key spaces and fingerprints, so that a row is written without a
        # lookup; changed only by committed transactions.
        self._space_ids: dict[Space, int] = {
            (t, ns, rank): i for i, t, ns, rank in self._db.execute(
                "SELECT id, tenant, namespace, rank FROM spaces")}
        self._fp_ids: dict[str, int] = dict(
            self._db.execute("SELECT fingerprint, id FROM fingerprints"))
        for suffix in SIDE_FILES:  # created by SQLite with the database's mode; older ones narrowed
            _narrow(Path(f"{path}{suffix}"))

    def _reset(self, stored: dict[str, str], wanted: dict[str, str], why: str = "") -> None:
        if stored:
            changed = sorted(k for k in set(stored) | set(wanted)
                             if stored.get(k) != wanted.get(k))
            reasons = [f"{k}: {stored.get(k)!r} -> {wanted.get(k)!r}" for k in changed]
            self.reset_reason = ", ".join([why, *reasons] if why else reasons)
        with self._transaction():
            # Dropped, not emptied: an older schema's tables have other columns.
            kinds = dict(self._db.execute("SELECT name, type FROM sqlite_master WHERE name IN"
                                          " ('chunks', 'entries', 'spaces', 'fingerprints')"))
            for name in ("chunks", "entries", "spaces", "fingerprints"):
                if name in kinds:
                    self._db.execute(f"DROP {kinds[name].upper()} {name}")
            for statement in _SCHEMA:
                self._db.execute(statement)
            self._db.execute("DELETE FROM meta")
            self._db.executemany("INSERT INTO meta VALUES (?, ?)", wanted.items())

    def _migrate(self, schema: str) -> None:
        """Schema 2 or 3 -> 4 in one transaction (a crash leaves the old schema, migrated at the
        next open; a file whose tables are not that schema's fails, and is reset); row order
        (the LRU order of the next recovery) is kept, and every field is copied as it was (a
        row recovery would drop stays one it drops)."""
        started = time.monotonic()
        self._db.create_function("kvtierd_pack", 4, _pack_v3, deterministic=True)
        cache = self._db.execute("PRAGMA cache_size").fetchone()[0]
        # The new table's primary key takes its rows in random key order: with the default
        # 2 MB cache every insert spilled a page to the WAL (27 s per 1M rows, half of it in
        # the kernel), with room for the whole index it is written once.
        self._db.execute(f"PRAGMA cache_size = {-MIGRATE_CACHE_KIB}")
        try:
            with self._transaction() as db:
                for step in MIGRATES_FROM[MIGRATES_FROM.index(schema):]:
                    for statement in _MIGRATE[step]:
                        db.execute(statement)
                db.execute("UPDATE meta SET v = ? WHERE k = 'schema'", (str(SCHEMA_VERSION),))
                rows = db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        finally:
            self._db.execute(f"PRAGMA cache_size = {cache}")
        # The old table's pages are free but still in the file, and the WAL grew to the whole
        # new table: give both back now (in /dev/shm they are RAM; ~1.5 s per 1M rows, once).
        # The rows are migrated already: a failure here only leaves the file larger.
        try:
            with self.lock:
                self._db.execute("VACUUM")
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.DatabaseError as exc:
            log.warning("index %s migrated but not compacted (%s): it keeps its old size",
                        self.path, exc)
        log.info("index %s migrated from schema %s to %d (%d rows) in %.2f s", self.path,
                 schema, SCHEMA_VERSION, rows, time.monotonic() - started)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN … COMMIT; on any exception ROLLBACK and re-raise, so no failure can leave the
        connection inside a transaction (every later BEGIN would fail)."""
        with self.lock:
            self._db.execute("BEGIN")
            try:
                if self.snapshot_token:  # rows change: no snapshot may stand for them any more
                    self._db.execute("DELETE FROM meta WHERE k = ?", (SNAPSHOT_KEY,))
                yield self._db
                self._db.execute("COMMIT")  # a failing COMMIT (disk full) rolls back too
                self.snapshot_token = ""
            except BaseException:
                if self._db.in_transaction:  # SQLite may have rolled back already
                    self._db.execute("ROLLBACK")
                raise

    def store_snapshot_token(self, token: str) -> None:
        """Name the snapshot just written (``index_restore.save``) in meta, committed: from now
        until the next write it stands for the rows."""
        with self.lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (SNAPSHOT_KEY, token))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self.snapshot_token = token

    def forget_snapshot(self) -> None:
        """Delete the snapshot token (committed): no snapshot stands for the rows any more."""
        with self._transaction():
            pass

    def count(self) -> int:
        with self.lock:
            return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def rows_written(self) -> int:
        """An upper bound of ``count()`` read in O(log n) (the largest row id), for progress
        messages: ``count()`` reads the whole index."""
        with self.lock:
            return self._db.execute("SELECT COALESCE(MAX(rowid), 0) FROM entries").fetchone()[0]

    def rows(self, batch: int = 10000) -> Iterator[IndexRow]:
        """Every row with its names, in the order written (for tools and tests: recovery reads
        ``row_batches``). Rows naming no space or fingerprint are left out, as in ``chunks``."""
        spaces, fps = self.space_names(), self.fingerprint_names()
        for fetched in self.row_batches(batch):
            for sid, key, packed in fetched:
                fid, nbytes, checksum, runs = index_format.unpack(packed)
                if sid in spaces and fid in fps:
                    yield IndexRow(*spaces[sid], bytes(key), fps[fid], nbytes, checksum,
                                   unpack_runs(runs))

    def row_batches(self, batch: int = 16384) -> Iterator[list[tuple]]:
        """Rows as stored, ``(space id, key, packed)`` (``index_format``), ``batch`` at a time,
        in the order they were written: recovery indexes them without an object per row
        (names: ``space_names``, ``fingerprint_names``)."""
        cur = self._db.execute("SELECT space, key, packed FROM entries ORDER BY rowid")
        while True:
            fetched = cur.fetchmany(batch)
            if not fetched:
                return
            yield fetched

    def space_names(self) -> dict[int, Space]:
        """Space id -> ``(tenant, namespace, rank)``, as the rows name them."""
        with self.lock:
            return {i: space for space, i in self._space_ids.items()}

    def fingerprint_names(self) -> dict[int, str]:
        with self.lock:
            return {i: fp for fp, i in self._fp_ids.items()}

    def clear(self) -> None:
        """Delete every row (and the spaces and fingerprints they named) in one transaction."""
        with self._transaction() as db:
            for table in ("entries", "spaces", "fingerprints"):
                db.execute(f"DELETE FROM {table}")
            self._space_ids.clear()  # under the lock; a failed COMMIT re-raises before this
            self._fp_ids.clear()

    def insert(self, rows: Iterable[IndexRow]) -> None:
        """Insert (or replace) rows in one durable transaction: all of them or none."""
        spaces: dict[Space, int] = {}  # made by this transaction: cached once it commits
        fps: dict[str, int] = {}
        with self._transaction() as db:
            params = [(self._space_id(db, (r.tenant, r.namespace, r.rank), spaces, True), r.key,
                       index_format.pack(self._fp_id(db, r.fingerprint, fps), r.nbytes,
                                         r.checksum, pack_runs(r.runs))) for r in rows]
            db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", params)
        # Committed. (A cache that lacks an id is harmless, _space_id looks it up; one with an
        # id the file lacks would not be: hence after COMMIT, never inside the transaction.)
        self._space_ids.update(spaces)
        self._fp_ids.update(fps)

    def delete(self, ikeys: Iterable[IKey]) -> None:
        """Delete rows by index key in one transaction: all of them or none."""
        with self._transaction() as db:
            stored = [(self._space_id(db, space, {}, False), key) for space, key in ikeys]
            db.executemany("DELETE FROM entries WHERE space = ? AND key = ?", stored)

    def delete_stored(self, stored: Iterable[StoredKey]) -> None:
        """Delete rows by ``(space id, key)`` as ``row_batches`` gave them (recovery's bad
        rows, including rows whose space id names no space), in one transaction."""
        with self._transaction() as db:
            db.executemany("DELETE FROM entries WHERE space = ? AND key = ?", stored)

    def _space_id(self, db: sqlite3.Connection, space: Space, made: dict[Space, int],
                  create: bool) -> int:
        """The id of ``space`` (made in this transaction if ``create``; else -1 if none)."""
        sid = self._space_ids.get(space)
        if sid is None:
            sid = made.get(space)
        if sid is None:
            found = db.execute("SELECT id FROM spaces WHERE tenant = ? AND namespace = ? AND"
                               " rank = ?", space).fetchone()
            if found is not None:
                sid = found[0]
            elif not create:
                return -1
            else:
                sid = db.execute("INSERT INTO spaces (tenant, namespace, rank) VALUES (?, ?, ?)",
                                 space).lastrowid
            made[space] = sid
        return sid

    def _fp_id(self, db: sqlite3.Connection, fingerprint: str, made: dict[str, int]) -> int:
        fid = self._fp_ids.get(fingerprint)
        if fid is None:
            fid = made.get(fingerprint)
        if fid is None:
            found = db.execute("SELECT id FROM fingerprints WHERE fingerprint = ?",
                               (fingerprint,)).fetchone()
            fid = found[0] if found is not None else db.execute(
                "INSERT INTO fingerprints (fingerprint) VALUES (?)", (fingerprint,)).lastrowid
            made[fingerprint] = fid
        return fid

    def close(self) -> None:
        with self.lock:
            self._db.close()


def _pack_v3(fp_id: object, nbytes: object, checksum: object, runs: object) -> bytes:
    """A schema-3 row's fields packed as schema 4 stores them (the migration's SQL function).
    A field that cannot be packed (a hand-edited file: text where a blob belongs, a size beyond
    i64) gives a row recovery drops (size -1), never an error that stops the daemon's start."""
    if isinstance(checksum, bytes) and isinstance(runs, bytes):
        try:
            return index_format.pack(fp_id, nbytes, checksum, runs)  # type: ignore[arg-type]
        except struct.error:
            pass
    return index_format.pack(fp_id if isinstance(fp_id, int) and 0 <= fp_id < 1 << 32 else 0,
                             -1, b"", b"")


def _create_private(path: Path) -> None:
    """Create the database file 0600 (whatever the umask) before SQLite opens it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def _narrow(path: Path) -> None:
    try:
        os.chmod(path, FILE_MODE, follow_symlinks=False)
    except FileNotFoundError:
        pass
