"""CUDA IPC staging: a client's device buffer, opened once per session, copied with DMA.

Implements the staging seam of ``kvtierd.staging`` (``check_range``, ``copy_in``, ``copy_out``,
``close``). HELLO carries ``{"kind": "cuda_ipc", "ticket": bytes, "handle": <64-byte
cudaIpcMemHandle_t>, "nbytes": int, "device": int, "pci_bus_id": str (optional)}``; the ticket of a
``cuda_ipc`` staging handshake gives the session its peer's credentials (``OpHandlers``); the daemon
opens the handle once (``cudaIpcOpenMemHandle``, on the device with that PCI bus id when given, as
device numbers differ between processes under ``CUDA_VISIBLE_DEVICES``) and closes it when the
session ends and no copy uses it any more.

Copies are ``cudaMemcpyAsync`` on one stream per device, one per contiguous run of arena bytes
(adjacent arena runs are merged; runs are cut where a pinned piece ends, see ``tiers.pinning``).
Each call records an event behind its own copies and waits for it, so copy threads sharing the
stream wait only for what they need. ``copy_in`` then hashes the arena bytes (xxh3-128) as the
memfd path does. A daemon without CuPy or a GPU refuses the HELLO with BAD_HANDLE and the reason.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from kvtierd.copy import memcpy
from kvtierd.protocol import ProtocolError, Status
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.pinning import PIECE_BYTES, split_at_pieces

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
            with cupy.cuda.Device(self.device):
                self.address = runtime.ipcOpenMemHandle(handle, IPC_LAZY_ENABLE_PEER_ACCESS)
        except Exception as exc:  # CUDARuntimeError: stale handle, wrong device, same process
            raise ProtocolError(Status.BAD_HANDLE,
                                f"cannot open the CUDA IPC handle on device "
                                f"{bus or client_device}: {exc}") from None
        self.name = f"cuda_ipc:{self.device}:{self.nbytes}"
        _counts["open_handles"] += 1
        _counts["opened_total"] += 1
        self.piece_bytes = piece_bytes
        self._stream = _stream(cupy, self.device)

    def check_range(self, offset: object, nbytes: object) -> str | None:
        return check_range(offset, nbytes, self.nbytes)

    def copy_in(self, offset: int, arena: Arena, segments: list[tuple[int, int]]) -> bytes:
        """Staging → arena (device to host), then the payload's xxh3-128 from the arena."""
        self._copy(offset, arena, segments, MEMCPY_DEVICE_TO_HOST)
        return memcpy.checksum(arena.view, segments)

    def copy_out(self, arena: Arena, segments: list[tuple[int, int]], offset: int) -> None:
        """Arena → staging (host to device); returns once the bytes are on the device."""
        self._copy(offset, arena, segments, MEMCPY_HOST_TO_DEVICE)

    def _copy(self, offset: int, arena: Arena, segments: list[tuple[int, int]], kind: int) -> None:
        cp = self._cupy
        memcpy_async = cp.cuda.runtime.memcpyAsync
        stream = self._stream
        with cp.cuda.Device(self.device):
            for pos, arena_offset, length in copy_plan(offset, segments, self.piece_bytes):
                device_ptr = self.address + pos
                host_ptr = arena.address + arena_offset
                if kind == MEMCPY_DEVICE_TO_HOST:
                    memcpy_async(host_ptr, device_ptr, length, kind, stream.ptr)
                else:
                    memcpy_async(device_ptr, host_ptr, length, kind, stream.ptr)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
            done.synchronize()

    def close(self) -> None:
        if not self.address:
            return
        # Every copy of this session waited for its own event: nothing of ours is in flight.
        cp = self._cupy
        with cp.cuda.Device(self.device):
            cp.cuda.runtime.ipcCloseMemHandle(self.address)
        self.address = 0
        _counts["open_handles"] -= 1
