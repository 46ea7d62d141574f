"""CUDA IPC staging: a client's device buffer, opened once per session, copied with DMA.

Implements the staging seam of ``kvtierd.staging`` (``check_range``, the ``copy_in`` calls,
``copy_out_many``, ``close``). HELLO carries ``{"kind": "cuda_ipc", "ticket": bytes, "handle": <64-byte
cudaIpcMemHandle_t>, "nbytes": int, "device": int, "pci_bus_id": str (optional)}``; the ticket of a
``cuda_ipc`` staging handshake gives the session its peer's credentials (``OpHandlers``); the daemon
opens the handle once (``cudaIpcOpenMemHandle``, on the device with that PCI bus id when given, as
device numbers differ between processes under ``CUDA_VISIBLE_DEVICES``) and closes it when the
session ends and no copy uses it any more. The announced ``nbytes`` is checked against the real
allocation (``cuMemGetAddressRange``, see ``cuda_health``) before the session exists: a larger one
is refused with BAD_HANDLE, as a copy past the mapping would fault the daemon's context for every
session on that GPU.

Copies are ``cudaMemcpyAsync`` on one stream per device, one per contiguous run of arena bytes
(adjacent arena runs are merged; runs are cut where a pinned piece ends, see ``tiers.pinning``).
Each call records an event behind its own copies and waits for it (a blocking event: the copy
thread sleeps, it does not spin), so copy threads sharing the stream wait only for what they need.
``copy_in`` then hashes the arena bytes (xxh3-128) as the memfd path does. A CUDA error in a copy
fails that copy; a sticky one marks the device lost (``cuda_health``): every later copy on it fails
at once and the daemon exits to be restarted with a fresh context. A daemon without CuPy or a GPU
refuses the HELLO with BAD_HANDLE and the reason.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from kvtierd import cuda_health
from kvtierd.copy import memcpy
from kvtierd.protocol import ProtocolError, Status
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.pinning import PIECE_BYTES, split_at_pieces

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64
MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2
IPC_LAZY_ENABLE_PEER_ACCESS = 1


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why this daemon cannot open CUDA IPC handles, or None when it can (checked once)."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as exc:  # CUDARuntimeError: no driver, driver too old
        return f"no usable CUDA driver or device ({exc})"
    return None


def parse_spec(spec: dict, max_bytes: int) -> tuple[bytes, int, int, str | None]:
    """``(handle, nbytes, device, pci_bus_id)`` of a cuda_ipc HELLO staging map, or BAD_HANDLE."""
    handle = spec.get("handle")
    if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
        raise ProtocolError(Status.BAD_HANDLE, f"cuda_ipc handle must be {IPC_HANDLE_BYTES} bytes "
                            f"(a cudaIpcMemHandle_t), got {type(handle).__name__} "
                            f"of length {len(handle) if isinstance(handle, bytes) else '-'}")
    nbytes = spec.get("nbytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= max_bytes:
        raise ProtocolError(Status.BAD_HANDLE,
                            f"staging nbytes {nbytes!r} must be an int in 1..{max_bytes}")
    device = spec.get("device")
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise ProtocolError(Status.BAD_HANDLE, f"cuda_ipc device {device!r} must be an int >= 0")
    bus = spec.get("pci_bus_id")
    if bus is not None and (not isinstance(bus, str) or not 0 < len(bus) <= 64):
        raise ProtocolError(Status.BAD_HANDLE,
                            f"cuda_ipc pci_bus_id {bus!r:.80} must be a short string")
    return handle, nbytes, device, bus


def copy_plan(staging_offset: int, segments: list[tuple[int, int]],
              piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int, int]]:
    """``(staging offset, arena offset, length)`` per DMA: adjacent arena runs merged (the staging
    side is contiguous), then cut at pinned-piece boundaries."""
    merged: list[list[int]] = []
    for offset, length in segments:
        if length <= 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1][1] += length
        else:
            merged.append([offset, length])
    plan = []
    pos = staging_offset
    for offset, length in merged:
        for start, step in split_at_pieces(offset, length, piece_bytes):
            plan.append((pos, start, step))
            pos += step
    return plan


def check_range(offset: object, nbytes: object, size: int) -> str | None:
    """Why ``(offset, nbytes)`` is not inside a ``size``-byte buffer, or None when it is."""
    if not isinstance(offset, int) or not isinstance(nbytes, int):
        return f"offset and nbytes must be ints, got {offset!r}, {nbytes!r}"
    if offset < 0 or nbytes <= 0 or offset + nbytes > size:
        return f"range [{offset}, {offset}+{nbytes}) is outside the staging buffer [0, {size})"
    return None


_counts = {"open_handles": 0, "opened_total": 0}  # the loop thread opens and closes handles


def stats() -> dict[str, int]:
    """CUDA IPC handles open now and opened since start (STATS shows them)."""
    return dict(_counts)


_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def _stream(cupy: Any, device: int) -> Any:
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            with cupy.cuda.Device(device):
                stream = cupy.cuda.Stream(non_blocking=True)
            _streams[device] = stream
        return stream


class CudaIpcStaging:
    """A client's device staging buffer, mapped into the daemon through its IPC handle."""

    kind = "cuda_ipc"

    def __init__(self, spec: dict, max_bytes: int, piece_bytes: int = PIECE_BYTES) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ProtocolError(
                Status.BAD_HANDLE,
                f"staging kind 'cuda_ipc' needs a daemon with CUDA; this one has none ({reason}): "
                "use 'memfd' staging, or install CuPy (kvtierd[cuda]) where a GPU is visible",
            )
        import cupy  # noqa: PLC0415

        handle, self.nbytes, client_device, bus = parse_spec(spec, max_bytes)
        self._cupy = cupy
        runtime = cupy.cuda.runtime
        by_bus = getattr(runtime, "deviceGetByPCIBusId", None)
        try:
            self.device = by_bus(bus) if bus and by_bus is not None else client_device
        except Exception as exc:  # CUDARuntimeError: no such bus id here
            raise ProtocolError(Status.BAD_HANDLE, f"no CUDA device with PCI bus id {bus!r} is "
                                f"visible to the daemon: {exc}") from None
        if self.device in cuda_health.lost():
            raise ProtocolError(Status.SHUTTING_DOWN, f"the daemon's CUDA context on device "
                                f"{self.device} was lost; it is restarting")
        try:
            self._stream = _stream(cupy, self.device)
        except Exception as exc:  # CUDARuntimeError: no such device in this process
            raise ProtocolError(Status.BAD_HANDLE, f"CUDA device {self.device} is not usable by "
                                f"the daemon: {exc}") from None
        self._handle = handle
        self.address = _acquire(cupy, handle, self.nbytes, self.device, bus or client_device)
        self.name = f"cuda_ipc:{self.device}:{self.nbytes}"
        _counts["open_handles"] += 1
        _counts["opened_total"] += 1
        self.piece_bytes = piece_bytes

    def check_range(self, offset: object, nbytes: object) -> str | None:
        return check_range(offset, nbytes, self.nbytes)

    def copy_in(self, offset: int, arena: Arena, segments: list[tuple[int, int]]) -> bytes:
        """Staging → arena (device to host), then the payload's xxh3-128 from the arena."""
        self._copy(offset, arena, segments, MEMCPY_DEVICE_TO_HOST)
        return memcpy.checksum(arena.view, segments)

    def copy_in_ranges(self, arena: Arena, srcs: list[int], dsts: list[int],
                       sizes: int | list[int]) -> list[bytes]:
        """``sizes`` (or ``sizes[i]``) bytes at staging offset ``srcs[i]`` → arena offset
        ``dsts[i]``; checksums."""
        each = [sizes] * len(srcs) if type(sizes) is int else sizes
        return [self.copy_in(src, arena, [(dst, nbytes)])
                for src, dst, nbytes in zip(srcs, dsts, each)]

    def copy_in_chunks(self, arena: Arena, offsets: list[int],
                       segments: list[list[tuple[int, int]]]) -> list[bytes]:
        """``copy_in`` of each ``(offsets[j], segments[j])``; checksums."""
        return [self.copy_in(offset, arena, segs) for offset, segs in zip(offsets, segments)]

    def copy_out_many(self, arena: Arena, srcs: list[int], dsts: list[int],
                      sizes: list[int]) -> None:
        """``sizes[i]`` bytes at arena offset ``srcs[i]`` → staging offset ``dsts[i]``."""
        for src, dst, nbytes in zip(srcs, dsts, sizes):
            self._copy(dst, arena, [(src, nbytes)], MEMCPY_HOST_TO_DEVICE)

    def _copy(self, offset: int, arena: Arena, segments: list[tuple[int, int]], kind: int) -> None:
        cuda_health.check_device(self.device)  # never copy on a context that faulted
        cp = self._cupy
        memcpy_async = cp.cuda.runtime.memcpyAsync
        stream = self._stream
        with cp.cuda.Device(self.device):
            try:
                for pos, arena_offset, length in copy_plan(offset, segments, self.piece_bytes):
                    device_ptr = self.address + pos
                    host_ptr = arena.address + arena_offset
                    if kind == MEMCPY_DEVICE_TO_HOST:
                        memcpy_async(host_ptr, device_ptr, length, kind, stream.ptr)
                    else:
                        memcpy_async(device_ptr, host_ptr, length, kind, stream.ptr)
                done = cp.cuda.Event(block=True, disable_timing=True)
                done.record(stream)
                done.synchronize()
            except cp.cuda.runtime.CUDARuntimeError as exc:
                lost = cuda_health.note_failure(cp, self.device, exc)
                if lost is not None:
                    raise lost from exc
                raise

    def close(self) -> None:
        if not self.address:
            return
        # Every copy of this session waited for its own event: nothing of ours is in flight.
        self.address = 0
        _counts["open_handles"] -= 1
        _release(self._cupy, self._handle, self.device)


# One mapping per (device, handle): a second session announcing a handle that is already open
# shares it (CUDA may hand back the same pointer for a second open in one process, so a close for
# one session would unmap the other's buffer under its copies). The loop thread opens and closes.
_mappings: dict[tuple[int, bytes], list[int]] = {}  # -> [address, allocation bytes, users]
_mappings_lock = threading.Lock()


def _acquire(cupy: Any, handle: bytes, nbytes: int, device: int, where: object) -> int:
    """The daemon's pointer to the allocation ``handle`` names, checked to hold ``nbytes``."""
    with _mappings_lock:
        mapping = _mappings.get((device, handle))
        if mapping is None:
            address, available = _open_checked(cupy, handle, device, where)
            mapping = _mappings[(device, handle)] = [address, available, 0]
        address, available, _ = mapping
        if nbytes > available:
            if mapping[2] == 0:
                del _mappings[(device, handle)]
                _close(cupy, address, device)
            raise ProtocolError(Status.BAD_HANDLE, f"staging nbytes {nbytes} is larger than the "
                                f"{available}-byte device allocation its CUDA IPC handle names; "
                                "allowed: at most the allocation (nothing was mapped)")
        mapping[2] += 1
        return address


def _release(cupy: Any, handle: bytes, device: int) -> None:
    with _mappings_lock:
        mapping = _mappings.get((device, handle))
        if mapping is None:
            return
        mapping[2] -= 1
        if mapping[2] > 0:
            return
        del _mappings[(device, handle)]
    _close(cupy, mapping[0], device)


def _close(cupy: Any, address: int, device: int) -> None:
    try:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.ipcCloseMemHandle(address)
    except Exception as exc:  # a lost context refuses every call; the exit frees it all
        log.warning("cudaIpcCloseMemHandle(0x%x) on device %d failed: %s", address, device, exc)


def _open_checked(cupy: Any, handle: bytes, device: int, where: object) -> tuple[int, int]:
    """Open ``handle`` on ``device``: ``(pointer, bytes of its allocation from the pointer on)``
    as ``cuMemGetAddressRange`` reports them, or BAD_HANDLE (with the handle closed again)."""
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(device):
        try:
            address = runtime.ipcOpenMemHandle(handle, IPC_LAZY_ENABLE_PEER_ACCESS)
        except Exception as exc:  # CUDARuntimeError: stale handle, wrong device, same process
            raise ProtocolError(Status.BAD_HANDLE, f"cannot open the CUDA IPC handle on device "
                                f"{where}: {exc}") from None
        try:
            base, size = cuda_health.allocation_range(cupy, address)
        except cuda_health.DriverError as exc:
            problem = f"cannot check the size of the CUDA IPC allocation: {exc}"
        except BaseException:
            _close(cupy, address, device)
            raise
        else:
            if base <= address < base + size:
                return address, base + size - address
            problem = (f"cuMemGetAddressRange puts the opened pointer 0x{address:x} outside "
                       f"its allocation [0x{base:x}, +{size})")
        _close(cupy, address, device)
    raise ProtocolError(Status.BAD_HANDLE, problem)
