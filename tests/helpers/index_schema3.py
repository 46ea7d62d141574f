"""Index files of schema 3 (before the packed row of schema 4), for the migration tests.

The DDL below is schema 3's, verbatim (``kvtierd/tiers/index_db.py`` up to commit 043b6c1);
``tests/data/index_schema3.sqlite`` is a file that code itself wrote (rows in
``index_schema3.json``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvtierd.tiers import index_format
from kvtierd.tiers.index_db import IndexRow, pack_runs

SCHEMA_3 = (
    "CREATE TABLE spaces (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, namespace TEXT NOT NULL,"
    " rank INTEGER NOT NULL, UNIQUE (tenant, namespace, rank))",
    "CREATE TABLE fingerprints (id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL UNIQUE)",
    "CREATE TABLE entries (space INTEGER NOT NULL, key BLOB NOT NULL, fingerprint INTEGER NOT NULL,"
    " nbytes INTEGER NOT NULL, checksum BLOB NOT NULL, runs BLOB NOT NULL,"
    " PRIMARY KEY (space, key))",
    "CREATE VIEW chunks AS SELECT s.tenant AS tenant, s.namespace AS namespace, s.rank AS rank,"
    " e.key AS key, f.fingerprint AS fingerprint, e.nbytes AS nbytes, e.checksum AS checksum,"
    " e.runs AS runs FROM entries e JOIN spaces s ON s.id = e.space"
    " JOIN fingerprints f ON f.id = e.fingerprint",
)


def write_schema_3(path: Path, rows: list[IndexRow], meta: dict[str, str]) -> None:
    """An index as a schema-3 daemon wrote it: one INSERT OR REPLACE per row, in order."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("BEGIN")
        db.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
        for statement in SCHEMA_3:
            db.execute(statement)
        db.executemany("INSERT INTO meta VALUES (?, ?)", {"schema": "3", **meta}.items())
        for r in rows:
            db.execute("INSERT OR IGNORE INTO spaces (tenant, namespace, rank) VALUES (?, ?, ?)",
                       (r.tenant, r.namespace, r.rank))
            db.execute("INSERT OR IGNORE INTO fingerprints (fingerprint) VALUES (?)",
                       (r.fingerprint,))
            db.execute(
                "INSERT OR REPLACE INTO entries SELECT s.id, ?, f.id, ?, ?, ? FROM spaces s,"
                " fingerprints f WHERE s.tenant = ? AND s.namespace = ? AND s.rank = ?"
                " AND f.fingerprint = ?",
                (r.key, r.nbytes, r.checksum, pack_runs(r.runs), r.tenant, r.namespace, r.rank,
                 r.fingerprint))
        db.execute("COMMIT")
    finally:
        db.close()


def downgrade_to_schema_3(path: Path) -> int:
    """Rewrite a (stopped daemon's) schema-4 index as schema 3 would have stored the same rows,
    in the same order; returns the rows."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("BEGIN")
        stored = db.execute("SELECT space, key, packed FROM entries ORDER BY rowid").fetchall()
        db.execute("DROP VIEW chunks")
        db.execute("DROP TABLE entries")
        for statement in SCHEMA_3[2:]:
            db.execute(statement)
        for space, key, packed in stored:
            fp_id, nbytes, checksum, runs = index_format.unpack(packed)
            db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                       (space, key, fp_id, nbytes, checksum, runs))
        db.execute("UPDATE meta SET v = '3' WHERE k = 'schema'")
        db.execute("COMMIT")
    finally:
        db.close()
    return len(stored)
