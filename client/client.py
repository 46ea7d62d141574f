"""``KVTierClient``: moves planned chunks between an engine's paged KV cache and kvtierd.

One worker thread owns the socket and the staging buffer, so ``store`` and ``load`` return futures
and run in submission order; ``lookup`` waits for its answer. Store: gather chunks into staging
(merged memmove runs on CPU, ``host_copies``; the GPU kernels and a CUDA IPC staging buffer for CUDA
tensors, see ``cuda_staging``), then PUT them. Load: GET into staging, then scatter the chunks that
hit. Both are cut into pieces with two requests in flight (``pipeline``), so the client's copy of
one piece overlaps the daemon's copy of another. A chunk is True only if its bytes are stored
(store) or now in its blocks (load).

When the daemon is down or slow, calls answer False for every chunk (with a warning) instead of
raising: an engine keeps serving without its cache. That includes ``connect``: with no daemon it
returns a client at once (a missing or dead ipc socket is seen without waiting for a timeout) whose
session opens on the first call after the daemon starts. A daemon that answers and refuses (a bad
token, an unsupported layout) raises from ``connect``. After a timeout the session is abandoned (the
daemon may still act on the old request) and a new one, with a new staging buffer, starts on the
next call; a restarted daemon is re-greeted the same way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Sequence

import torch

from kvtierd.paths import client_socket, unreachable_reason
from kvtierd.protocol import STORED, Op, Status, Tier

from . import host_copies, pipeline
from .copies import CopyUnit, build_page_tables
from .layout import KVLayout
from .planner import Chunk
from .cuda_staging import CudaCopier, CudaStagingBuffer, tables_device
from .handshake import handshake, handshake_path
from .staging import MemfdStagingBuffer, align
from .transport import DaemonError, DaemonUnavailable, Transport

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 * 1024**2


class _GroupLimits(NamedTuple):
    """One offloadable group as the client checks and sizes its chunks."""

    blocks_per_chunk: int
    blocks: int  # blocks in the KV cache: ids are 0..blocks-1, or -1 (nothing to copy)
    chunk_nbytes: int


class KVTierClient:
    def __init__(
        self,
        address: str,
        layout: KVLayout,
        kv_caches: dict[str, torch.Tensor],
        *,
        namespace: str | None = None,
        staging_bytes: int | None = None,
        timeout_s: float = 30.0,
        heartbeat_s: float = 5.0,
        token: str = "",
        piece_bytes: int | None = None,
    ) -> None:
        if piece_bytes is not None and piece_bytes <= 0:
            raise ValueError(f"piece_bytes={piece_bytes}; allowed: a positive size, or None for "
                             "the default (pipeline.piece_target, host_piece_target)")
        self._piece_bytes = piece_bytes  # bytes per request; None: the path's default
        self.layout = layout
        self.namespace = namespace or layout.namespace
        self._tables = build_page_tables(layout, kv_caches)
        device = tables_device(self._tables)  # CUDA: GPU kernels and a CUDA IPC staging buffer
        self._cuda = (CudaCopier(self._tables, layout.blocks_per_chunk, device)
                      if device.type == "cuda" else None)
        # CPU tensors: merged memmove runs (host_copies), byte-identical to the torch reference
        self._host = host_copies.geometries(self._tables) if self._cuda is None else None
        if self._host is not None:
            host_copies.warm_up()  # compiled here, not inside the first store
        # Per offloadable group, what every call checks or sizes its chunks by: blocks per chunk,
        # blocks in the KV cache, payload bytes (looked up once here, not per chunk and call).
        self._groups = {g: _GroupLimits(layout.blocks_per_chunk[g],
                                        self._tables[g][0].pages.shape[0], layout.chunk_nbytes(g))
                        for g, ok in enumerate(layout.offloadable) if ok}
        largest = max((limits.chunk_nbytes for limits in self._groups.values()), default=0)
        self.staging_bytes = staging_bytes or max(DEFAULT_STAGING_BYTES, align(largest) * 2)
        if align(largest) > self.staging_bytes:
            raise ValueError(f"staging_bytes={self.staging_bytes} cannot hold one chunk of "
                             f"{largest} bytes; allowed: >= {align(largest)}")
        self._token = token
        self._transport = Transport(address, timeout_s)
        self._staging: MemfdStagingBuffer | Any = None  # or a CudaStagingBuffer
        self._limits: dict[str, int] = {}
        self._events = False
        self.session_id: int | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-client")
        self._last_call = time.monotonic()
        self._closed = threading.Event()
        try:
            self._executor.submit(self._first_session).result()  # daemon down: not an error
        except BaseException:
            self._discard()
            raise
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,),
                                           name="kvtier-heartbeat", daemon=True)
        self._heartbeat.start()

    def _discard(self) -> None:
        """The constructor failed: release what it made. No PUT or GET went out, so no daemon
        copy can target a staging buffer, and the copier frees every one at once (a worker that
        retries every few seconds would otherwise leak its staging each time)."""
        self._closed.set()
        self._executor.shutdown(wait=True)
        self._transport.close()
        if self._cuda is not None:
            self._cuda.close()

    @classmethod
    def connect(cls, address: str | None = None, *, layout: KVLayout,
                kv_caches: dict[str, torch.Tensor], **options: Any) -> KVTierClient:
        """Connect to the daemon at ``address`` (default: ``kvtierd.paths.client_socket()``, the
        socket a default ``kvtierd serve`` binds) and open a session (HELLO) if it is up."""
        return cls(address or client_socket(), layout, kv_caches, **options)

    # -- public API ------------------------------------------------------------------------------
    def store(self, chunks: Sequence[Chunk]) -> Future[list[bool]]:
        chunks = self._checked(chunks)
        ready = self._cuda.caller_ready() if self._cuda else None  # the caller's KV writes
        return self._executor.submit(self._guarded, self._store, chunks, ready)

    def load(self, chunks: Sequence[Chunk]) -> Future[list[bool]]:
        chunks = self._checked(chunks)
        ready = self._cuda.caller_ready() if self._cuda else None
        return self._executor.submit(self._guarded, self._load, chunks, ready)

    def lookup(self, chunks: Sequence[Chunk], lease: bool = False) -> list[bool]:
        chunks = self._checked(chunks)
        return self._executor.submit(self._guarded, self._lookup, chunks, lease).result()

    def delete(self, chunks: Sequence[Chunk]) -> list[bool]:
        chunks = self._checked(chunks)
        return self._executor.submit(self._guarded, self._delete, chunks).result()

    def stats(self) -> dict:
        return self._executor.submit(lambda: self._call(Op.STATS)[0]["stats"]).result()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._executor.submit(self._bye).result()
        self._executor.shutdown(wait=True)
        if self._cuda is not None:
            self._cuda.close()  # frees the retired device staging buffers

    def __enter__(self) -> KVTierClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- validation ------------------------------------------------------------------------------
    def _checked(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        if self._closed.is_set():
            raise RuntimeError("KVTierClient is closed")
        out = list(chunks)
        groups = self._groups
        for chunk in out:
            g = chunk.group
            limits = groups.get(g)
            if limits is None:
                raise ValueError(f"chunk group {g} is not an offloadable group of this layout; "
                                 f"allowed: {sorted(groups)}")
            ids = chunk.block_ids
            if len(ids) != limits.blocks_per_chunk:
                raise ValueError(f"group {g}: chunk has {len(ids)} block ids; allowed: "
                                 f"exactly blocks_per_chunk={limits.blocks_per_chunk}")
            if min(ids) < -1 or max(ids) >= limits.blocks:  # ids are never empty (bpc >= 1)
                bad = [b for b in ids if b != -1 and not 0 <= b < limits.blocks]
                raise ValueError(f"group {g}: block ids {bad} are outside the KV cache; allowed: "
                                 f"0..{limits.blocks - 1} or -1")
        return out

    # -- worker-thread side ----------------------------------------------------------------------
    def _guarded(self, fn: Any, chunks: list[Chunk], *args: Any) -> list[bool]:
        try:
            return fn(chunks, *args)
        except DaemonUnavailable as exc:
            log.warning("kvtierd unavailable, %d chunk(s) treated as misses: %s", len(chunks), exc)
            self._abandon_session()
            return [False] * len(chunks)

    def _first_session(self) -> None:
        try:
            self._ensure_session()
        except DaemonUnavailable as exc:
            log.warning("kvtierd is not reachable (%s): calls answer misses until it is; the "
                        "session opens on the first call after it starts", exc)

    def _ensure_session(self) -> None:
        """HELLO with a fresh staging buffer, handed over by the staging handshake first."""
        if self._staging is not None:
            return
        reason = unreachable_reason(self._transport.address)
        if reason is not None:  # no daemon for sure: say so now, not after timeout_s
            raise DaemonUnavailable(f"kvtierd at {self._transport.address}: {reason}")
        staging = (self._cuda.new_staging(self.staging_bytes) if self._cuda
                   else MemfdStagingBuffer(self.staging_bytes))
        hello_sent = False
        try:
            path = handshake_path(self._transport)
            ticket, _ = handshake(path, staging.handshake_kind, staging.nbytes,
                                  staging.fd, self._transport.timeout_s)
            staging.release_fd()  # the daemon has mapped its own copy of the descriptor
            hello_sent = True
            header, _ = self._transport.call(
                Op.HELLO, namespace=self.namespace, rank=self.layout.rank,
                world_size=self.layout.world_size,
                fingerprint=self.layout.fingerprint, staging=staging.handle(ticket),
                token=self._token, client={"pid": os.getpid(), "library": "kvtier_client"})
        except BaseException as exc:  # HandshakeError, DaemonUnavailable, DaemonError: no session
            # Refused, or its handle never sent: the daemon holds no mapping of a device buffer,
            # which goes at once. A HELLO left unanswered may still be mapped late: retired.
            if isinstance(staging, CudaStagingBuffer) and (
                    not hello_sent or isinstance(exc, DaemonError)):
                staging.free()
            else:
                staging.close()
            self._transport.reset()
            raise
        self._staging = staging
        self._limits = header["limits"]
        self._events = bool(header.get("events"))  # the daemon publishes KV events
        self.session_id = header["session"]

    def _staging_tensor(self) -> torch.Tensor:
        assert self._staging is not None, "no session"
        return self._staging.tensor

    def _abandon_session(self) -> None:
        self._transport.reset()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self.session_id = None

    def _call(self, op: Op, **fields: Any) -> tuple[dict, list]:
        """One request in a live session. If the daemon forgot the session (it restarted), greet
        it again with a new staging buffer and ask once more."""
        return self._retrying(lambda: self._transport.call(op, **fields))

    def _retrying(self, request: Any) -> Any:
        for attempt in (0, 1):
            self._ensure_session()
            self._last_call = time.monotonic()
            try:
                return request()
            except DaemonError as exc:
                if exc.status != Status.NO_SESSION or attempt:
                    raise
                log.info("kvtierd lost session %s (restarted?); greeting it again",
                         self.session_id)
                self._abandon_session()
        raise AssertionError("unreachable")

    def _pieces(self, chunks: list[Chunk]) -> list[pipeline.Piece]:
        """The call's chunks as staging pieces (``pipeline.plan``), with the session's limits."""
        groups = self._groups
        total = sum(groups[c.group].chunk_nbytes for c in chunks)
        target = self._piece_bytes or (
            pipeline.host_piece_target(total, self.staging_bytes) if self._host is not None
            else pipeline.piece_target(total, self.staging_bytes))
        return pipeline.plan(chunks, lambda c: groups[c.group].chunk_nbytes,
                             self.staging_bytes, target, self._limits.get("max_batch", 1024))

    def _depth(self) -> int:
        return max(1, min(pipeline.DEPTH, self._limits.get("max_in_flight_requests",
                                                           pipeline.DEPTH)))

    def _units(self, piece: pipeline.Piece) -> list[CopyUnit]:
        return [CopyUnit(c.group, tuple(c.block_ids), off) for c, off in piece.slots]

    def _items(self, piece: pipeline.Piece) -> list[list]:
        groups = self._groups
        return [[c.key, off, groups[c.group].chunk_nbytes] for c, off in piece.slots]

    def _gather(self, units: list[CopyUnit], ready: Any) -> None:
        if self._host is not None:
            host_copies.gather(self._host, units, self._staging_tensor())
        else:  # returns once the bytes are in staging: the PUT may go
            self._cuda.gather(units, self._staging, ready)

    def _scatter(self, units: list[CopyUnit], ready: Any) -> None:
        if self._host is not None:
            host_copies.scatter(self._host, units, self._staging_tensor())
        else:  # returns once the blocks hold the bytes: the load's future may resolve
            self._cuda.scatter(units, self._staging, ready)

    def _pipelined(self, op: Op, chunks: list[Chunk], before: Any, after: Any,
                   fields: Any = None) -> list[bool]:
        """``chunks`` through ``pipeline.run`` as ``op`` requests (``fields(piece)``: more request
        fields); all of it again, once, in a new session if the daemon forgot ours (a store
        re-puts, a load re-reads: both are safe)."""
        if not chunks:
            return []

        def send(piece: pipeline.Piece) -> int:
            more = fields(piece) if fields is not None else {}
            return self._transport.send(op, items=self._items(piece), **more)

        def attempt() -> list[bool]:
            return pipeline.run(
                self._pieces(chunks), self._depth(), before, send,
                lambda request_id: self._transport.receive(op, request_id)[0], after)

        return self._retrying(attempt)

    def _store(self, chunks: list[Chunk], ready: Any = None) -> list[bool]:
        def fields(piece: pipeline.Piece) -> dict[str, Any]:
            if not self._events:
                return {}
            # the daemon announces stores: say which engine blocks each covers
            return {"blocks": [_blocks(c) for c, _ in piece.slots]}

        return self._pipelined(
            Op.PUT, chunks, lambda piece: self._gather(self._units(piece), ready),
            lambda piece, header: [status in STORED for status in header["results"]], fields)

    def _load(self, chunks: list[Chunk], ready: Any = None) -> list[bool]:
        def scatter_hits(piece: pipeline.Piece, header: dict) -> list[bool]:
            hits = [status == Status.OK for status in header["results"]]
            self._scatter([u for u, hit in zip(self._units(piece), hits) if hit], ready)
            return hits

        return self._pipelined(Op.GET, chunks, lambda piece: None, scatter_hits)

    def _lookup(self, chunks: list[Chunk], lease: bool) -> list[bool]:
        out: list[bool] = []
        step = self._limits.get("max_batch", 1024)
        for i in range(0, len(chunks), step):
            header, _ = self._call(Op.LOOKUP, keys=[c.key for c in chunks[i:i + step]], lease=lease)
            out.extend(tier != Tier.NONE for tier in header["tiers"])
        return out

    def _delete(self, chunks: list[Chunk]) -> list[bool]:
        out: list[bool] = []
        step = self._limits.get("max_batch", 1024)
        for i in range(0, len(chunks), step):
            header, _ = self._call(Op.DELETE, keys=[c.key for c in chunks[i:i + step]])
            out.extend(status == Status.OK for status in header["results"])
        return out

    def _bye(self) -> None:
        if self._staging is not None:
            try:
                self._transport.call(Op.BYE)
            except (DaemonUnavailable, DaemonError) as exc:
                log.debug("BYE not answered: %s", exc)
        self._abandon_session()
        self._transport.close()

    def _beat(self, period_s: float) -> None:
        """Keep the session alive while the engine is idle (the daemon reaps silent sessions)."""
        while not self._closed.wait(period_s):
            if time.monotonic() - self._last_call < period_s:
                continue
            try:
                self._executor.submit(self._ping)
            except RuntimeError:
                return  # executor shut down: closing

    def _ping(self) -> None:
        if self._closed.is_set() or self._staging is None:
            return
        try:
            self._call(Op.PING)
        except (DaemonUnavailable, DaemonError) as exc:
            log.warning("kvtierd heartbeat failed: %s", exc)
            self._abandon_session()


def _blocks(chunk: Chunk) -> dict[str, Any] | None:
    """A chunk's entry of PUT's ``blocks`` (kvtierd.event_blocks): hashes only, no token ids (they
    would multiply the header; routers learn tokens from the engine's own events)."""
    if not chunk.hashes:
        return None
    return {"hashes": list(chunk.hashes), "parent": chunk.parent, "group": chunk.group}
