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

The files (the database and SQLite's ``-wal``/``-shm`` beside it) are 0600: they hold tenants,
namespaces and prefix hashes. SQLite gives the -wal/-shm files the database file's mode, so the
database file is created 0600 before SQLite opens it, and older files are narrowed to 0600.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from kvtierd.tiers.allocator import Run

SCHEMA_VERSION = 2
FILE_MODE = 0o600
SIDE_FILES = ("-wal", "-shm")  # SQLite's WAL files next to the database

IKey = tuple[tuple[str, str, int], bytes]  # ((tenant, namespace, rank), key)


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
        else the index is reset (the caller logs why) and ``self.reset_reason`` says so."""
        self.path = path
        self.lock = threading.Lock()
        self.reset_reason = ""
        _create_private(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
        wanted = {"schema": str(SCHEMA_VERSION), **meta}
        stored = dict(self._db.execute("SELECT k, v FROM meta").fetchall())
        if stored != wanted:
            if stored:
                changed = sorted(k for k in set(stored) | set(wanted)
                                 if stored.get(k) != wanted.get(k))
                self.reset_reason = ", ".join(
                    f"{k}: {stored.get(k)!r} -> {wanted.get(k)!r}" for k in changed)
            with self._transaction():
                # Dropped, not emptied: an older schema's table has other columns.
                self._db.execute("DROP TABLE IF EXISTS chunks")
                self._create_chunks()
                self._db.execute("DELETE FROM meta")
                self._db.executemany("INSERT INTO meta VALUES (?, ?)", wanted.items())
        for suffix in SIDE_FILES:  # created by SQLite with the database's mode; older ones narrowed
            _narrow(Path(f"{path}{suffix}"))

    def _create_chunks(self) -> None:
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS chunks (tenant TEXT NOT NULL, namespace TEXT NOT NULL,"
            " rank INTEGER NOT NULL, key BLOB NOT NULL, fingerprint TEXT NOT NULL,"
            " nbytes INTEGER NOT NULL, checksum BLOB NOT NULL, runs BLOB NOT NULL,"
            " PRIMARY KEY (tenant, namespace, rank, key))"
        )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN … COMMIT; on any exception ROLLBACK and re-raise, so no failure can leave the
        connection inside a transaction (every later BEGIN would fail)."""
        with self.lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
                self._db.execute("COMMIT")  # a failing COMMIT (disk full) rolls back too
            except BaseException:
                if self._db.in_transaction:  # SQLite may have rolled back already
                    self._db.execute("ROLLBACK")
                raise

    def count(self) -> int:
        with self.lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def rows(self, batch: int = 10000) -> Iterator[IndexRow]:
        cur = self._db.execute(
            "SELECT tenant, namespace, rank, key, fingerprint, nbytes, checksum, runs FROM chunks"
        )
        while True:
            fetched = cur.fetchmany(batch)
            if not fetched:
                return
            for tenant, ns, rank, key, fp, nbytes, checksum, runs in fetched:
                yield IndexRow(tenant, ns, rank, bytes(key), fp, nbytes, bytes(checksum),
                               unpack_runs(runs))

    def row_batches(self, batch: int = 4096) -> Iterator[list[tuple]]:
        """Rows as SQLite returns them, ``(tenant, namespace, rank, key, fingerprint, nbytes,
        checksum, runs blob)``, ``batch`` at a time: recovery indexes them without an object per
        row."""
        cur = self._db.execute(
            "SELECT tenant, namespace, rank, key, fingerprint, nbytes, checksum, runs FROM chunks"
        )
        while True:
            fetched = cur.fetchmany(batch)
            if not fetched:
                return
            yield fetched

    def clear(self) -> None:
        """Delete every row in one transaction."""
        with self._transaction() as db:
            db.execute("DELETE FROM chunks")

    def insert(self, rows: Iterable[IndexRow]) -> None:
        """Insert (or replace) rows in one durable transaction: all of them or none."""
        with self._transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                ((r.tenant, r.namespace, r.rank, r.key, r.fingerprint, r.nbytes, r.checksum,
                  pack_runs(r.runs)) for r in rows),
            )

    def delete(self, ikeys: Iterable[IKey]) -> None:
        """Delete rows by index key in one transaction: all of them or none."""
        with self._transaction() as db:
            db.executemany(
                "DELETE FROM chunks WHERE tenant = ? AND namespace = ? AND rank = ? AND key = ?",
                ((space[0], space[1], space[2], key) for space, key in ikeys),
            )

    def close(self) -> None:
        with self.lock:
            self._db.close()


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
