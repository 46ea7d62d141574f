"""Pinning the arena for DMA: ``cudaHostRegister`` in pieces, on a background thread.

A GPU copies to and from host memory at full speed only if that memory is page-locked and known to
the driver. Registering a large arena takes seconds (the driver walks and pins every page), so it
runs off the start-up path: the daemon serves at once, copies into not-yet-registered pieces are
merely slower (the driver stages them), and ``stats()`` reports progress and readiness, which the
daemon's STATS shows under ``tiers.cpu.pinning``.

Each piece is at most ``PIECE_BYTES`` (64 GiB: each call stays bounded, and a stop takes effect
between pieces) and is registered ``cudaHostRegisterPortable`` so that every device's context sees it
as pinned. A copy must not span two pieces (one registration each): ``split_at_pieces`` cuts copy
ranges at piece boundaries. Without CuPy or a GPU the state is ``unavailable`` with the reason.

Lifecycle: ``start()`` → states ``pinning`` → ``ready`` (or ``failed``/``unavailable``);
``close()`` stops between pieces and unregisters what was registered, before the arena is unmapped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

log = logging.getLogger(__name__)

PIECE_BYTES = 64 * 1024**3
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class HostRegistrar(Protocol):
    """The two driver calls pinning needs (CuPy's runtime in production)."""

    def register(self, address: int, nbytes: int) -> None: ...
    def unregister(self, address: int) -> None: ...


class CupyRegistrar:
    """``cudaHostRegister`` through CuPy; constructing it raises RuntimeError without CUDA."""

    def __init__(self) -> None:
        try:
            import cupy  # noqa: PLC0415 - optional: the GPU path only
        except ImportError as exc:
            raise RuntimeError(f"CuPy is not installed ({exc})") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError: no driver, no device
            raise RuntimeError(f"no usable CUDA device ({exc})") from None
        if count < 1:
            raise RuntimeError("no CUDA device is visible")
        self._runtime = cupy.cuda.runtime
        self._device = cupy.cuda.Device(0)

    def register(self, address: int, nbytes: int) -> None:
        with self._device:
            self._runtime.hostRegister(address, nbytes, HOST_REGISTER_PORTABLE)

    def unregister(self, address: int) -> None:
        with self._device:
            self._runtime.hostUnregister(address)


def pieces(nbytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of each registration piece of an ``nbytes`` region."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes={piece_bytes}; allowed: a positive size")
    return [(off, min(piece_bytes, nbytes - off)) for off in range(0, nbytes, piece_bytes)]


def split_at_pieces(offset: int, length: int, piece_bytes: int = PIECE_BYTES
                    ) -> list[tuple[int, int]]:
    """Cut the arena range ``[offset, offset + length)`` where it crosses a piece boundary."""
    out = []
    while length > 0:
        room = piece_bytes - offset % piece_bytes
        step = min(room, length)
        out.append((offset, step))
        offset += step
        length -= step
    return out


class ArenaPinner:
    """Registers ``[address, address + nbytes)`` piece by piece on its own thread."""

    def __init__(self, address: int, nbytes: int, *, piece_bytes: int = PIECE_BYTES,
                 registrar: HostRegistrar | None = None) -> None:
        self.address = address
        self.nbytes = nbytes
        self.piece_bytes = piece_bytes
        self._registrar = registrar
        self.state = "off"
        self.reason = ""
        self.pinned_bytes = 0
        self.seconds = 0.0
        self._done: list[tuple[int, int]] = []  # registered pieces, unregistered at close
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        self.state = "pinning"
        self._thread = threading.Thread(target=self._run, name="kvtierd-pin", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread; True once it ended (any state)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            registrar = self._registrar if self._registrar is not None else CupyRegistrar()
            self._registrar = registrar
        except RuntimeError as exc:
            self.state, self.reason = "unavailable", str(exc)
            log.info("arena not registered with CUDA: %s", exc)
            return
        for offset, length in pieces(self.nbytes, self.piece_bytes):
            if self._stop.is_set():
                self.state, self.reason = "stopped", "the daemon stopped before pinning ended"
                return
            try:
                registrar.register(self.address + offset, length)
            except Exception as exc:  # a driver error: copies still work, slower
                self.state, self.reason = "failed", f"cudaHostRegister of {length} bytes: {exc}"
                log.warning("arena pinning failed after %d of %d bytes: %s (copies work, "
                            "unpinned)", self.pinned_bytes, self.nbytes, exc)
                return
            self._done.append((offset, length))
            self.pinned_bytes += length
            self.seconds = time.perf_counter() - started
        self.state = "ready"
        log.info("arena pinned for DMA: %d bytes in %.2f s", self.pinned_bytes, self.seconds)

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, "pinned_bytes": self.pinned_bytes,
                "total_bytes": self.nbytes, "seconds": round(self.seconds, 3),
                "reason": self.reason}

    def close(self) -> None:
        """Stop between pieces, then unregister every registered piece (before the unmap)."""
        self._stop.set()
        self.wait()
        while self._done:
            offset, _ = self._done.pop()
            try:
                assert self._registrar is not None
                self._registrar.unregister(self.address + offset)
            except Exception as exc:
                log.warning("cudaHostUnregister of the arena at +%d failed: %s", offset, exc)
        self.pinned_bytes = 0
