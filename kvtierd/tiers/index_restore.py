"""A tier's index at start (from its snapshot, or from its rows) and at a clean stop (the
snapshot), for both tiers that recover from rows: the warm arena and NVMe.

The rows (``ChunkIndexDB``) are the authority; the snapshot (``index_snapshot``) is a faster
copy of what they say, trusted only while nothing has written the database since it was taken:

* **stop** (``save``): only when the tier is idle (no chunk pending, read, leased, demoting or
  on its way out: the index holds exactly the chunks the rows name) and the row count agrees;
  the file is written and fsynced first, and only then its random token stored in the
  database's meta. Anything else, or any failure, leaves no valid snapshot (logged).
* **start** (``restore``): the snapshot is loaded only if its token is the one the database
  names, its meta and geometry are the index's and its checksum verifies; otherwise the rows
  are read as before, with the reason logged. Either way the token is deleted (committed) and
  the file unlinked before the tier serves or writes anything, so that after this start the
  rows are again the only truth. ``ChunkIndexDB`` also clears the token on the first write of
  any connection (an offline tool, the benchmark's row filler).

A crash leaves either no token (the rows are read) or a token whose snapshot describes the rows
exactly (nothing has been written since it was stored).
"""

from __future__ import annotations

import collections
import logging
import secrets
import sqlite3
import time
from collections import Counter
from itertools import repeat
from typing import Callable

from kvtierd.tiers import index_snapshot
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.base import TierIndex
from kvtierd.tiers.index_db import ChunkIndexDB
from kvtierd.tiers.index_format import same
from kvtierd.tiers.index_snapshot import Snapshot, SnapshotRejected
from kvtierd.tiers.recovery import Loaded, load_rows

log = logging.getLogger(__name__)


def restore(tier: TierIndex, db: ChunkIndexDB, *, verified: bool, reset: Callable[[], None],
            progress: Callable[[int], None] | None = None) -> tuple[Loaded, str]:
    """Index ``tier``'s chunks (its ``index`` and ``policy``, empty) from the snapshot when it
    stands for ``db``'s rows, else from the rows; returns what was loaded and from where
    (``"snapshot"`` or ``"rows"``). ``reset``: gives the tier a fresh index and policy (a
    snapshot that fails while loading: the rows are read instead)."""
    started = time.monotonic()
    path = index_snapshot.path_for(db.path)
    snap: Snapshot | None = None
    try:
        snap = index_snapshot.read(path, token=db.snapshot_token, meta=db.meta,
                                   num_pages=tier.num_pages)
    except SnapshotRejected as exc:
        log.log(logging.WARNING if exc.damaged else logging.INFO,
                "%s index %s: snapshot not used (%s); reading the rows", tier.name, db.path, exc)
    forget(db)  # before anything is served or written: the rows are the only truth again
    loaded = None
    if snap is not None:
        try:
            loaded = _load(tier, snap, verified)
        except Exception:  # a bug, never the file's bytes (checked): still a start, from rows
            log.exception("%s index %s: snapshot failed to load; reading the rows", tier.name,
                          db.path)
            reset()
    source = "snapshot" if loaded is not None else "rows"
    if loaded is None:
        loaded = load_rows(db, tier.index, tier.policy, tier.part_of, tier.num_pages,
                           verified=verified, progress=progress)
    log.info("%s index %s: %d chunks from %s in %.2f s", tier.name, db.path, len(tier.index),
             source, time.monotonic() - started)
    return loaded, source


def forget(db: ChunkIndexDB) -> None:
    """Delete the snapshot token (committed) and then the file (a crash in between leaves a
    file whose token nobody names): also for a start that does not recover the index."""
    path = index_snapshot.path_for(db.path)
    if db.snapshot_token:
        db.forget_snapshot()
    path.unlink(missing_ok=True)
    index_snapshot.temp_path_for(db.path).unlink(missing_ok=True)


def _load(tier: TierIndex, snap: Snapshot, verified: bool) -> Loaded:
    index, policy = tier.index, tier.policy
    index.import_columns(snap.columns, verified=verified)
    n = len(index)
    parts = [tier.part_of_tenant(index.key_space(tuple(space)).tenant)  # type: ignore[union-attr]
             for space in snap.columns["spaces"]]
    if len(set(parts)) <= 1:
        policy.insert_many(range(n), parts[0] if parts else -1)
    else:  # tenants with their own partitions (quotas): slot by slot, in order
        for slot, sid in enumerate(snap.columns["space"]):
            policy.insert(slot, parts[sid])
    allocator = PageAllocator.from_page_map(snap.page_map)
    return Loaded(allocator, pages=snap.pages, tenant_pages=Counter(snap.tenant_pages))


def save(tier: TierIndex, db: ChunkIndexDB, busy: str = "") -> bool:
    """Write ``tier``'s snapshot at a clean stop (the caller has drained every copy and job);
    ``busy``: why the tier is not idle, by the tier's own counts ("" if it is). Returns
    whether a valid snapshot now stands for the rows; never raises (a stop never fails for it).
    """
    started = time.monotonic()
    path = index_snapshot.path_for(db.path)
    index = tier.index
    index.compact()
    if not busy and (index.active or index.reads or index.retired):
        busy = f"{len(index.active)} chunks in use"
    order = [] if busy else list(tier.policy.victims())
    if not busy and len(order) != len(index):
        busy = f"{len(index) - len(order)} chunks outside the eviction order"
    try:
        rows = db.count() if not busy else -1
        if not busy and rows != len(index):
            busy = f"{rows} rows for {len(index)} chunks"
        if busy:
            log.info("%s index %s: no snapshot at stop (%s); the next start reads the rows",
                     tier.name, db.path, busy)
            return False
        columns = index.export_columns(order)
        page_map, pages, tenant_pages = _pages(columns, tier.num_pages, index.page_bytes)
        if page_map.count(1) != pages:
            log.error("%s index %s: chunks share pages; no snapshot", tier.name, db.path)
            return False
        token = secrets.token_hex(16)
        size = index_snapshot.write(path, meta=db.meta, num_pages=tier.num_pages, token=token,
                                    columns=columns, page_map=page_map, pages=pages,
                                    tenant_pages=tenant_pages)
        db.store_snapshot_token(token)
    except (OSError, sqlite3.Error) as exc:
        log.warning("%s index %s: snapshot not written (%s); the next start reads the rows",
                    tier.name, db.path, exc)
        path.unlink(missing_ok=True)
        return False
    log.info("%s index %s: snapshot of %d chunks (%d bytes) written in %.2f s", tier.name,
             path, len(order), size, time.monotonic() - started)
    return True


def busy(**counts: int) -> str:
    """Why a tier is not idle, from its own counts (``save``'s ``busy``): "" when all are 0."""
    return ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in counts.items() if n)


def _pages(columns: dict, num_pages: int, page_bytes: int
           ) -> tuple[bytearray, int, dict[str, int]]:
    """The page map (1 = used) of the exported chunks, their pages and pages per tenant (one
    C-level pass when every chunk is one run of the same size, the common case)."""
    page_map = bytearray(num_pages)
    multi, spaces, sizes = columns["multi"], columns["spaces"], columns["nbytes"]
    tenant_pages: Counter[str] = Counter()
    if sizes and not multi and same(sizes):
        count = max(1, -(-sizes[0] // page_bytes))
        if count == 1:
            collections.deque(map(page_map.__setitem__, columns["start"], repeat(1)), maxlen=0)
        else:
            for first in columns["start"]:
                page_map[first:first + count] = b"\1" * count
        for space, keys in zip(spaces, columns["key_dicts"]):
            tenant_pages[space[0]] += count * len(keys)
        return page_map, count * len(sizes), dict(tenant_pages)
    pages = 0
    for slot, (sid, nbytes, start) in enumerate(zip(columns["space"], sizes, columns["start"])):
        runs = multi.get(slot) or [(start, max(1, -(-nbytes // page_bytes)))]
        for first, count in runs:
            page_map[first:first + count] = b"\1" * count
            pages += count
            tenant_pages[spaces[sid][0]] += count
    return page_map, pages, dict(tenant_pages)
