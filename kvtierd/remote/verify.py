"""Checking what the remote tier's read jobs fetched, before the chain may commit a byte of it.

``Verifier.submit(arena, reads, raws)`` checks one Mooncake call's objects on a thread of its own
(so a job's next call is on the wire meanwhile) and gives each read its payload's checksum or the
item's error:

* a header and payload that are this chunk's: the xxh3-128 of the payload;
* a header or checksum that is not (flipped bytes, another tenant's or layout's header):
  ``IntegrityError`` (the chain drops the entry, the object is removed and counted);
* a read that failed (``MooncakeStore.get`` gave a code): missing (``OBJECT_NOT_FOUND``) is a
  plain ``RemoteMiss``; any other code is told apart by reading the object whole once (failed
  reads only): not a whole chunk with its header (truncated, grown, cut before its header) is an
  ``IntegrityError`` too, so it is removed instead of being promised by every node's existence
  check until Mooncake evicts it; a whole valid chunk of another size (the reader asked the
  wrong size) or a transfer that failed with the right length is a plain miss, and the object
  is left for the readers that ask right.

A plain miss's name is remembered (``take_missing``) so that the tier only forgets the object
instead of removing it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvtierd.copy.memcpy import checksum as payload_checksum
from kvtierd.remote import objects
from kvtierd.remote.mooncake import OBJECT_NOT_FOUND
from kvtierd.remote.reads import Read
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.lower import IntegrityError


class RemoteMiss(Exception):
    """The object is not (or no longer) in the store, or has another size: a plain miss."""


class Verifier:
    def __init__(self, store: Any, threads: int) -> None:
        """``store``: the ``MooncakeStore`` (its ``whole`` reads a failed read's object);
        ``threads``: one per I/O thread, since each running read job keeps one call's check in
        flight (with one thread for all, concurrent GETs queued their checks behind each other
        and one core's xxh3 bounded the tier's fetch rate)."""
        self.store = store
        self.threads = threads
        self._missing: set[str] = set()  # written by verifier threads, read on the loop
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started by the first read

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads,
                                                    thread_name_prefix="kvtierd-remote-verify")
        return self._pool

    def submit(self, arena: Arena, part: list[Read], raws: list[bytes | int]) -> Future:
        """The check of one call's reads: a future of their checksums or errors, in order."""
        return self.pool().submit(self._check_part, arena, part, raws)

    def take_missing(self, name: str) -> bool:
        """Whether a read found ``name`` a plain miss (forgotten here, then)."""
        with self._lock:
            missing = name in self._missing
            self._missing.discard(name)
        return missing

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _check_part(self, arena: Arena, part: list[Read], raws: list[bytes | int]
                    ) -> list[bytes | Exception]:
        return [self.checked(arena, read, raw) for read, raw in zip(part, raws)]

    def checked(self, arena: Arena, read: Read, raw: bytes | int) -> bytes | Exception:
        """The payload's checksum if ``raw`` (the header read) and the payload are this chunk's;
        else the item's error."""
        nbytes = sum(length for _, length in read.segments)
        if raw.__class__ is int:
            problem = self._failed(read, nbytes, raw)  # type: ignore[arg-type]
            if isinstance(problem, RemoteMiss):
                with self._lock:
                    self._missing.add(read.name)
            return problem
        try:
            header = objects.check_header(raw, read.name, read.entry.ikey,  # type: ignore[arg-type]
                                          read.entry.fingerprint, nbytes)
        except objects.HeaderMismatch as exc:
            return IntegrityError(f"remote object {read.name}: {exc}")
        got = payload_checksum(arena.view, read.segments)
        if got != header.checksum:
            return IntegrityError(f"remote object {read.name}: payload checksum {got.hex()} "
                                  f"differs from its header's {header.checksum.hex()}")
        return got

    def _failed(self, read: Read, nbytes: int, code: int) -> Exception:
        """Why a read of ``nbytes`` failed with ``code`` (the module docstring's cases)."""
        if code == OBJECT_NOT_FOUND:
            return RemoteMiss(f"{read.name}: not in the store")
        whole = self.store.whole(read.name)
        if whole is None:
            return RemoteMiss(f"{read.name}: the read failed (Mooncake code {code}) and the "
                              "object cannot be read whole")
        length = len(whole) - objects.HEADER_BYTES
        if length == nbytes:
            return RemoteMiss(f"{read.name}: the read failed (Mooncake code {code}); the object "
                              "has the right length")
        if objects.whole_chunk_length(whole, read.name, read.entry.ikey,
                                      read.entry.fingerprint) == length:
            return RemoteMiss(f"{read.name}: a whole chunk of {length} bytes, the reader asked "
                              f"for {nbytes}")
        return IntegrityError(f"remote object {read.name}: {len(whole)} bytes in the store, not "
                              f"a chunk with its header (a chunk of {nbytes} bytes is "
                              f"{nbytes + objects.HEADER_BYTES})")
