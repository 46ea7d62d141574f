"""A tier's crash-safe chunk index: SQLite in WAL mode (stdlib).

Why SQLite rather than our own append-only journal: atomic multi-row transactions, crash safety
and page reuse (no compaction pass) come with the standard library and are tested far beyond
what a hand-written journal would be; WAL keeps a commit to one sequential append plus an fsync.

Rule the tiers follow: a row is inserted only after the pages it names are durable, and a row is
deleted (committed) before its pages can be reused. So after a crash every row names a complete
chunk, and every page no row names is free. Checksums guard the remaining cases (bit rot, a page
changed behind our back): every read is verified before a byte reaches a client.

One connection, used by one thread at a time (the caller serialises; ``check_same_thread`` is off
so that the owning thread may be an I/O worker).
"""

from __future__ import annotations

import sqlite3
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvtierd.tiers.allocator import Run

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class IndexRow:
    namespace: str
    rank: int
    key: bytes
    fingerprint: str
    nbytes: int
    checksum: bytes
    runs: list[Run]

    @property
    def ikey(self) -> tuple[tuple[str, int], bytes]:
        return ((self.namespace, self.rank), self.key)


def pack_runs(runs: list[Run]) -> bytes:
    return b"".join(struct.pack("<QQ", start, count) for start, count in runs)


def unpack_runs(blob: bytes) -> list[Run]:
    return [struct.unpack_from("<QQ", blob, i) for i in range(0, len(blob), 16)]


class ChunkIndexDB:
    def __init__(self, path: Path, meta: dict[str, str], synchronous: str = "FULL") -> None:
        """Open (or create) the index at ``path``; ``meta`` must match what the file recorded,
        else the index is reset (the caller logs why) and ``self.reset_reason`` says so."""
        self.path = path
        self.lock = threading.Lock()
        self.reset_reason = ""
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS chunks (namespace TEXT NOT NULL, rank INTEGER NOT NULL,"
            " key BLOB NOT NULL, fingerprint TEXT NOT NULL, nbytes INTEGER NOT NULL,"
            " checksum BLOB NOT NULL, runs BLOB NOT NULL, PRIMARY KEY (namespace, rank, key))"
        )
        wanted = {"schema": str(SCHEMA_VERSION), **meta}
        stored = dict(self._db.execute("SELECT k, v FROM meta").fetchall())
        if stored and stored != wanted:
            changed = sorted(k for k in set(stored) | set(wanted) if stored.get(k) != wanted.get(k))
            self.reset_reason = ", ".join(
                f"{k}: {stored.get(k)!r} -> {wanted.get(k)!r}" for k in changed
            )
            self._db.execute("DELETE FROM chunks")
        if stored != wanted:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM meta")
            self._db.executemany("INSERT INTO meta VALUES (?, ?)", wanted.items())
            self._db.execute("COMMIT")

    def count(self) -> int:
        with self.lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def rows(self, batch: int = 10000) -> Iterator[IndexRow]:
        cur = self._db.execute(
            "SELECT namespace, rank, key, fingerprint, nbytes, checksum, runs FROM chunks"
        )
        while True:
            fetched = cur.fetchmany(batch)
            if not fetched:
                return
            for ns, rank, key, fp, nbytes, checksum, runs in fetched:
                yield IndexRow(ns, rank, bytes(key), fp, nbytes, bytes(checksum), unpack_runs(runs))

    def insert(self, rows: list[IndexRow]) -> None:
        """Insert (or replace) rows in one durable transaction."""
        with self.lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(r.namespace, r.rank, r.key, r.fingerprint, r.nbytes, r.checksum,
                  pack_runs(r.runs)) for r in rows],
            )
            self._db.execute("COMMIT")

    def delete(self, ikeys: list[tuple[tuple[str, int], bytes]]) -> None:
        with self.lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "DELETE FROM chunks WHERE namespace = ? AND rank = ? AND key = ?",
                [(space[0], space[1], key) for space, key in ikeys],
            )
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self._db.close()
