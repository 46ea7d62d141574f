"""Mooncake Store as kvtierd's remote store: batched, zero-copy, blocking calls.

``MooncakeStore`` wraps Mooncake's ``MooncakeDistributedStore`` (Python package
``mooncake-transfer-engine``; the ``remote`` extra) with what the remote tier needs and nothing
else: connect, register the arena, and batched ``exists`` / ``put`` / ``get`` / ``remove`` of whole
objects (header + payload). Every call blocks (network), so only the tier's jobs call it, on the
I/O engine's threads; Mooncake's client is thread-safe.

Zero-copy: the arena is registered with Mooncake's transfer engine once (``register_buffer``), and
so is a small pool of header slots; a put sends ``[arena segments..., header slot]`` with
``batch_put_from_multi_buffers`` and a get lands the same way with ``batch_get_into_multi_buffers``,
so payload bytes move between the arena and the remote segment without an intermediate copy (a
chunk's non-contiguous pages are separate buffers of one object). A get whose payload is followed
by room of the reader's own (``inline``) lands the header there instead: one buffer less, and one
transfer less (Mooncake moves each buffer as a transfer of its own).

Faults: a whole-store failure (master unreachable, RPC timeout) raises ``TierUnavailable`` (the
chain then skips the tier for ``retry_s``); a per-object failure (not found, no space) is a result
code. Mooncake reconnects to a restarted master by itself; objects whose metadata died with the
old master are simply misses.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import mmap
import os
import socket
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence
from urllib.parse import urlsplit

from kvtierd.config_remote import RemoteConfig
from kvtierd.remote.objects import HEADER_BYTES
from kvtierd.tiers.lower import TierUnavailable

log = logging.getLogger(__name__)

#: Mooncake's ErrorCode values (mooncake-store/include/types.h) that the tier tells apart.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
#: Codes that mean "the store as a whole is not answering", not "this object": RPC_FAIL,
#: the etcd/metadata errors, and INTERNAL_ERROR from a client whose master went away.
UNAVAILABLE_CODES = frozenset({-900, -1000, -1001, -1002, -1003, -1})
#: Header slots: one per object in flight; a batch larger than the pool waits for slots.
HEADER_SLOT_BYTES = 128


class RemoteSetupError(RuntimeError):
    """The remote store cannot be used at all (package missing, master unreachable at start)."""


def _import_store():
    return _module().MooncakeDistributedStore


def _module():
    """``mooncake.store``, or RemoteSetupError naming what to install."""
    try:
        from mooncake import store
    except ImportError as exc:
        raise RemoteSetupError(
            f"[remote] backend \"mooncake\" needs Mooncake's Python client ({exc}): install the "
            "remote extra (pip install 'kvtierd[remote]', which brings "
            "mooncake-transfer-engine-non-cuda; on GPU nodes mooncake-transfer-engine) and the "
            "Debian libraries libibverbs1 and librdmacm1") from None
    return store


def _bind_transfer_engine(hostname: str) -> None:
    """Mooncake's TCP transport listens on all interfaces unless ``MC_TCP_BIND_ADDRESS`` says
    otherwise: bind it to the address other nodes are told to use (an operator's own setting
    wins; a host name is left to Mooncake)."""
    try:
        ipaddress.ip_address(hostname.strip("[]"))
    except ValueError:
        return
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname.strip("[]"))


class HeaderPool:
    """Registered header slots, handed out to jobs (thread-safe)."""

    def __init__(self, slots: int) -> None:
        self.nbytes = slots * HEADER_SLOT_BYTES
        self._mmap = mmap.mmap(-1, self.nbytes)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)
        self._free = list(range(slots))
        self._cond = threading.Condition()

    @contextmanager
    def take(self, count: int) -> Iterator[list[int]]:
        """``count`` slot addresses (at most the pool's size), returned when the block ends."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= count)
            slots = [self._free.pop() for _ in range(count)]
        try:
            yield [self.address + s * HEADER_SLOT_BYTES for s in slots]
        finally:
            with self._cond:
                self._free.extend(slots)
                self._cond.notify_all()

    def write(self, address: int, header: bytes) -> None:
        offset = address - self.address
        self.view[offset : offset + len(header)] = header

    def close(self) -> None:
        self.view.release()
        del self._anchor
        self._mmap.close()


class MooncakeStore:
    """One connection to a Mooncake Store; see the module docstring."""

    def __init__(self, cfg: RemoteConfig) -> None:
        self.cfg = cfg
        self._store = None
        self._put_config = None  # ReplicateConfig with cfg.replicas, made at connect
        self._registered: list[int] = []
        self.headers = HeaderPool(cfg.max_batch)

    # -- lifecycle -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Set up the client (mounting ``global_segment_bytes`` into the pool), or raise
        ``RemoteSetupError`` naming the master and metadata service.

        Mooncake's ``setup`` holds the GIL for its whole run, and with the master down it retries
        for about 90 s: the whole daemon would stall. So the master's and the metadata server's
        ports are probed first (``connect_timeout_s`` each), and setup runs only when both
        answer (then it takes milliseconds)."""
        store_cls = _import_store()
        cfg = self.cfg
        where = (f"master {cfg.master_addr}, metadata {cfg.metadata_url}, protocol "
                 f"{cfg.protocol}")
        for what, host, port in self._endpoints():
            try:
                socket.create_connection((host, port), timeout=cfg.connect_timeout_s).close()
            except OSError as exc:
                raise RemoteSetupError(f"Mooncake {what} {host}:{port} unreachable ({exc}); "
                                       f"{where}") from None
        _bind_transfer_engine(cfg.local_hostname)
        store = store_cls()
        rc = store.setup(cfg.local_hostname, cfg.metadata_url, cfg.global_segment_bytes,
                         cfg.local_buffer_bytes, cfg.protocol, cfg.device, cfg.master_addr)
        if rc != 0:
            raise RemoteSetupError(f"Mooncake Store setup failed with code {rc} ({where}); is "
                                   "mooncake_master running and reachable?")
        self._store = store
        self._put_config = _module().ReplicateConfig()
        self._put_config.replica_num = cfg.replicas
        self.register(self.headers.address, self.headers.nbytes)
        log.info("remote tier: Mooncake Store at %s (metadata %s, %s, segment %d bytes)",
                 cfg.master_addr, cfg.metadata_url, cfg.protocol, cfg.global_segment_bytes)

    def _endpoints(self) -> list[tuple[str, str, int]]:
        host, _, port = self.cfg.master_addr.rpartition(":")
        out = [("master", host.strip("[]"), int(port))]
        if self.cfg.metadata_url != "P2PHANDSHAKE":
            url = urlsplit(self.cfg.metadata_url)
            out.append(("metadata server", url.hostname or "", url.port or 80))
        return out

    def register(self, address: int, nbytes: int) -> None:
        """Register memory for zero-copy transfers (the arena; the header pool)."""
        rc = self._client().register_buffer(address, nbytes)
        if rc != 0:
            raise RemoteSetupError(f"Mooncake register_buffer of {nbytes} bytes failed with "
                                   f"code {rc}")
        self._registered.append(address)

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            for address in self._registered:
                store.unregister_buffer(address)
            store.close()
        self._registered.clear()
        self.headers.close()

    def _client(self):
        if self._store is None:
            raise TierUnavailable("the Mooncake client is not connected")
        return self._store

    # -- batched object calls (blocking; jobs only) ------------------------------------------------
    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each object exists; ``TierUnavailable`` when the store does not answer.
        One call without copies when the names fit one batch (a 1024-key check is
        latency-bound: copying and converting its answers showed in benchmarks/remote_tier.py)."""
        client = self._client()
        if len(names) <= self.cfg.max_batch:
            codes = client.batch_is_exist(names if isinstance(names, list) else list(names))
            self._raise_if_down(codes, "batch_is_exist")
            return [code == 1 for code in codes]
        out: list[bool] = []
        for part in self._batches(names):
            codes = client.batch_is_exist(list(part))
            self._raise_if_down(codes, "batch_is_exist")
            out.extend([code == 1 for code in codes])
        return out

    def put(self, names: Sequence[str], headers: Sequence[bytes],
            payloads: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
        """Store each object as its payload buffers ``(address, length)`` (inside registered
        memory) then its header; Mooncake's code per object: 0 stored, ``OBJECT_ALREADY_EXISTS``
        (an object of that name is there: whose, the caller checks), else refused."""
        out: list[int] = []
        for start in range(0, len(names), self.cfg.max_batch):
            end = start + self.cfg.max_batch
            out.extend(self._put_part(names[start:end], headers[start:end],
                                      payloads[start:end]))
        return out

    def _put_part(self, names, headers, payloads) -> list[int]:
        with self.headers.take(len(names)) as slots:
            ptrs, sizes = [], []
            for slot, header, buffers in zip(slots, headers, payloads):
                self.headers.write(slot, header)
                ptrs.append([a for a, _ in buffers] + [slot])
                sizes.append([n for _, n in buffers] + [len(header)])
            codes = self._client().batch_put_from_multi_buffers(list(names), ptrs, sizes,
                                                                self._put_config)
        self._raise_if_down(codes, "batch_put_from_multi_buffers")
        return list(codes)

    def get(self, names: Sequence[str], payloads: Sequence[Sequence[tuple[int, int]]],
            inline: Sequence[bool]) -> list[bytes | int]:
        """Read each object into its payload buffers and its header after them: into the
        ``HEADER_BYTES`` right after the last payload buffer where ``inline`` (memory the reader
        owns), else into a header slot. The header bytes where exactly ``payload +
        HEADER_BYTES`` bytes arrived, else Mooncake's code: ``OBJECT_NOT_FOUND`` for a missing
        object; another (TRANSFER_FAIL -800, -600) for one of another length, or a failed
        transfer, which ``whole`` tells apart."""
        out: list[bytes | int] = []
        for start in range(0, len(names), self.cfg.max_batch):
            end = start + self.cfg.max_batch
            out.extend(self._get_part(names[start:end], payloads[start:end], inline[start:end]))
        return out

    def _get_part(self, names, payloads, inline) -> list[bytes | int]:
        slotted = [i for i, here in enumerate(inline) if not here]
        with self.headers.take(len(slotted)) as slots:
            where = dict(zip(slotted, slots))
            ptrs, sizes, wanted, headers = [], [], [], []
            for i, buffers in enumerate(payloads):
                addresses = [a for a, _ in buffers]
                lengths = [n for _, n in buffers]
                slot = where.get(i)
                if slot is None:  # the header lands right after the payload's last byte
                    lengths[-1] += HEADER_BYTES
                    headers.append(addresses[-1] + lengths[-1] - HEADER_BYTES)
                else:
                    addresses.append(slot)
                    lengths.append(HEADER_BYTES)
                    headers.append(slot)
                ptrs.append(addresses)
                sizes.append(lengths)
                wanted.append(sum(lengths))
            codes = self._client().batch_get_into_multi_buffers(list(names), ptrs, sizes)
            self._raise_if_down(codes, "batch_get_into_multi_buffers")
            return [ctypes.string_at(header, HEADER_BYTES) if code == want
                    else (code if code < 0 else OBJECT_NOT_FOUND)
                    for header, code, want in zip(headers, codes, wanted)]

    def whole(self, name: str) -> bytes | None:
        """The whole object ``name`` (header included) through Mooncake's copying get, or None
        when it cannot be read. Only for reads that failed (``get``): to tell an object of
        another length from a transfer that failed."""
        try:
            data = self._client().get(name)
        except Exception as exc:  # the binding raises for RPC errors; a miss is b""
            log.debug("Mooncake get of %s failed: %s", name, exc)
            return None
        return bytes(data) if data else None

    def remove(self, names: Sequence[str]) -> list[bool]:
        """Remove each object (forced: a reader's lease must not keep a corrupt object alive);
        True where removed or already gone."""
        out: list[bool] = []
        for part in self._batches(names):
            codes = self._client().batch_remove(list(part), True)
            self._raise_if_down(codes, "batch_remove")
            out.extend(code in (0, OBJECT_NOT_FOUND) for code in codes)
        return out

    def _batches(self, names: Sequence[str]) -> Iterator[Sequence[str]]:
        for start in range(0, len(names), self.cfg.max_batch):
            yield names[start : start + self.cfg.max_batch]

    @staticmethod
    def _raise_if_down(codes: Sequence[int], call: str) -> None:
        """A batch whose every answer says "store unreachable" is the store being down; a batch
        with some such answers (partial failure) is too: the breaker then stops the retries that
        would each wait for Mooncake's RPC timeout."""
        if UNAVAILABLE_CODES.isdisjoint(codes):  # the common case, in C
            return
        down = [c for c in codes if c in UNAVAILABLE_CODES]
        if down:
            raise TierUnavailable(f"Mooncake {call}: {len(down)} of {len(codes)} keys failed "
                                  f"with store errors (code {down[0]})")
