"""vLLM's own KV-event path: the manager's ``take_events()`` reports what this engine offloaded.

With ``--kv-events-config`` on, vLLM's scheduler drains ``OffloadingManager.take_events()`` every
step and publishes the ``OffloadingEvent``s through the engine's own publisher, under the engine's
own topic, which routers already subscribe to; with ``self_describing_kv_events`` it fills in the
token ids, parent hash and per-block hashes it snapshotted from the request (the manager never
sees them). So this is the path a router should use for vLLM engines.

What the manager knows by itself is only what *it* stored (``complete_store``: stored on ``CPU``,
the daemon's arena). Everything that happens to those chunks later in the daemon (demotion to
NVMe, eviction, DELETE, a failed check, a daemon restart) it learns from the daemon's own event
stream when ``kvtierd_events_address`` names it (the daemon's ``events_addr``): a SUB socket
drained, without waiting, on each ``take_events`` call. Per key it keeps the media it reported,
so each store is matched by one removal and vLLM's tracker can free its snapshot; without the
address there are no removals, and vLLM's self-describing tracker keeps a snapshot per stored key
(set the address whenever vLLM's KV events are on).

The daemon names a vLLM chunk by its last block hash and group (``jobs.job_chunks`` sends them),
so an event maps back to the ``OffloadKey`` (hash + 4-byte group) exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgpack
import zmq
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadKey

log = logging.getLogger(__name__)

MEDIA = {"CPU": Medium.CPU, "STORAGE": Medium.STORAGE}  # the daemon's media vLLM has names for
MAX_MESSAGES_PER_STEP = 1024  # bounds what one scheduler step spends on the daemon's stream


class EventFeed:
    """``OffloadingEvent``s of one manager: its own stores, and the daemon's later moves of them."""

    def __init__(self, address: str = "") -> None:
        self._out: list[OffloadingEvent] = []
        self._sub: zmq.Socket | None = None
        self._media: dict[bytes, set[Medium]] = {}  # only kept when the daemon's stream is read
        # (hash as published, group) → key: the daemon publishes a hash as bytes or, by default,
        # as vLLM does, as the uint64 of its last 8 bytes (which no key can be rebuilt from)
        self._names: dict[tuple[bytes | int, int], bytes] = {}
        if address:
            self._sub = zmq.Context.instance().socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.connect(address)

    def stored(self, keys: Iterable[bytes]) -> None:
        """``complete_store`` succeeded: the chunks are in the daemon's CPU tier.

        What the daemon's stream already delivered is applied first: it was sent before this
        store completed, so an ``AllBlocksCleared`` among it (a start) must not void this store.
        """
        self._drain()
        new = [k for k in keys if self._sub is None or self._add(k, Medium.CPU)]
        if new:
            self._out.append(OffloadingEvent(keys=[OffloadKey(k) for k in new], medium=Medium.CPU,
                                             removed=False, removal_expected=self._sub is not None))

    def take(self) -> list[OffloadingEvent]:
        self._drain()
        out, self._out = self._out, []
        return out

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    # -- the daemon's stream ----------------------------------------------------------------------
    def _add(self, key: bytes, medium: Medium) -> bool:
        media = self._media.get(key)
        if media is None:
            media = self._media[key] = set()
            for name in _names(key):
                self._names[name] = key
        if medium in media:
            return False
        media.add(medium)
        return True

    def _forget(self, key: bytes) -> None:
        del self._media[key]
        for name in _names(key):
            self._names.pop(name, None)

    def _drain(self) -> None:
        if self._sub is None:
            return
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                _ts, events, _rank = msgpack.unpackb(frames[-1])
                for event in events:
                    self._apply(event)
            except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
                log.warning("kvtierd event batch not understood (%s); skipped", exc)

    def _apply(self, event: dict) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":  # the daemon restarted: what it held is unknown now
            by_medium: dict[Medium, list[OffloadKey]] = {}
            for key, media in self._media.items():
                for medium in media:
                    by_medium.setdefault(medium, []).append(OffloadKey(key))
            self._media.clear()
            self._names.clear()
            self._out.extend(OffloadingEvent(keys=keys, medium=m, removed=True)
                             for m, keys in by_medium.items())
            return
        medium = MEDIA.get(event.get("medium"))
        group = event.get("group_idx")
        if medium is None or not isinstance(group, int):
            return  # another tier, or not a vLLM chunk
        keys = [self._names[(h, group)] for h in event["block_hashes"]
                if (h, group) in self._names]  # only chunks this engine stored
        if kind == "BlockStored":
            keys = [k for k in keys if self._add(k, medium)]
        elif kind == "BlockRemoved":
            keys = [k for k in keys if medium in self._media[k]]
            for k in keys:
                self._media[k].discard(medium)
                if not self._media[k]:
                    self._forget(k)
        else:
            return
        if keys:
            self._out.append(OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=medium,
                                             removed=kind == "BlockRemoved",
                                             removal_expected=kind == "BlockStored"))


def _names(key: bytes) -> tuple[tuple[bytes | int, int], ...]:
    """How the daemon's events name an OffloadKey (block hash + 4-byte group): by the hash's bytes
    or by its uint64 (vLLM's ``maybe_convert_block_hash``), with the group."""
    block_hash, group = key[:-4], int.from_bytes(key[-4:], "big")
    return (block_hash, group), (int.from_bytes(block_hash, "big") & (2**64 - 1), group)
