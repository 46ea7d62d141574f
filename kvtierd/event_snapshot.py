"""What the KV events announced, kept across a clean restart, so routers learn of recovered chunks.

A restart voids what the last run announced (``AllBlocksCleared`` at stop and at start), but
chunks in an NVMe tier or a re-attached arena are still served. Without this, a KV-aware router
would not send their prefixes here until they were stored again. So a clean stop writes what is
announced (``KVEvents.announced``: per tier and chunk, the engine hashes of its PUT's ``blocks``)
to a snapshot beside the data that survives, and the next start re-announces, after its
``AllBlocksCleared``, every entry whose chunk that start recovered in that tier (``BlockStored``
without token ids, as vLLM's own "these blocks are here too" events).

Only a clean stop writes one, and a start deletes it as soon as it has read it: after a crash
nothing is re-announced (routers then under-report this node, never over-report it). The remote
tier is never re-announced: this node forgets what it published, and the store may have evicted
it since. The file is msgpack, 0600 (it names tenants, namespaces and prefix hashes), written to
a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Hashable, Mapping

import msgpack

from kvtierd.event_blocks import BlockInfo
from kvtierd.tiers.arena import SHM_DIR

log = logging.getLogger(__name__)

FORMAT = 1
#: The tiers whose chunks outlive the process (the remote tier's are not this node's to claim).
RESTORED_TIERS = ("cpu", "nvme")

Announced = dict[tuple, BlockInfo | None]  # (tier, tenant, namespace, key) → what was announced


def save(path: Path, announced: Announced) -> int:
    """Write the announcements of the restorable tiers to ``path``; returns how many (0, logged,
    when it cannot be written: a stop never fails for it, the next start re-announces nothing)."""
    try:
        return _write(path, announced)
    except OSError as exc:
        log.warning("KV-event snapshot %s not written (%s): the next start will not re-announce "
                    "what it recovers", path, exc)
        return 0


def _write(path: Path, announced: Announced) -> int:
    rows = [[tier, tenant, namespace, key, None if info is None else
             [list(info.hashes), info.parent, info.group]]
            for (tier, tenant, namespace, key), info in announced.items()
            if tier in RESTORED_TIERS]
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgpack.packb({"format": FORMAT, "rows": rows}, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows)


def take(path: Path) -> list[tuple[str, Hashable, BlockInfo | None]]:
    """The snapshot's announcements as ``(tier, ikey of rank 0, info)``, and the file deleted
    (a crash after this start must not re-announce what this run may have dropped). A missing,
    unreadable or foreign file gives nothing (logged)."""
    try:
        raw = path.read_bytes()
        path.unlink()
    except FileNotFoundError:
        return []
    except OSError as exc:  # unreadable, or not a file: this start never uses it, nor a later one
        log.warning("KV-event snapshot %s not used (%s): recovered chunks not re-announced",
                    path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return []
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if not isinstance(doc, dict):
            raise ValueError(f"a {type(doc).__name__}, expected a map")
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        out = []
        for tier, tenant, namespace, key, info in doc["rows"]:
            blocks = None if info is None else BlockInfo(tuple(info[0]), info[1], (), 0, info[2])
            out.append((str(tier), ((str(tenant), str(namespace), 0), bytes(key)), blocks))
        return out
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        log.warning("KV-event snapshot %s unreadable (%s): recovered chunks not re-announced",
                    path, exc)
        return []


def path_for(cfg: Any, arena_name: str) -> Path | None:
    """Where a clean stop leaves its snapshot: beside the data that outlives the process (the
    NVMe directory, else a persistent arena's files in /dev/shm); None when nothing does."""
    if cfg.nvme_bytes:
        return cfg.resolved_nvme_dir() / "events.snapshot"
    return SHM_DIR / f"{arena_name}.events" if cfg.cpu_persistent else None


def recovered(path: Path, indexes: Mapping[str, Any]) -> list[tuple[str, Hashable,
                                                                    BlockInfo | None]]:
    """The snapshot's entries (taken: the file is gone after) whose chunk the tier's index
    (``indexes[tier]``, a ``ChunkIndex``) holds after this start's recovery."""
    held = [(tier, ikey, info) for tier, ikey, info in take(path)
            if tier in indexes and indexes[tier].slot(ikey) >= 0]
    if held:
        log.info("KV events: %d recovered chunk copies to re-announce (%s)", len(held), path)
    return held


def take_for(cfg: Any, arena_name: str, indexes: Mapping[str, Any]
             ) -> list[tuple[str, Hashable, BlockInfo | None]]:
    """At start, ``recovered`` from this daemon's snapshot (``path_for``), if it keeps one. Taken
    even with events off: a later run must never re-announce an old snapshot."""
    path = path_for(cfg, arena_name)
    return [] if path is None else recovered(path, indexes)
