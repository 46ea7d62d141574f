"""The client's GPU path: a device staging buffer shared with the daemon by a CUDA IPC handle.

``CudaCopier`` is what ``KVTierClient`` uses when the KV cache is on a GPU:

* ``new_staging(nbytes)`` allocates the staging buffer with a plain ``cudaMalloc`` (an IPC handle
  names a whole allocation, so never a pool sub-block) and exports its handle for HELLO:
  ``{"kind": "cuda_ipc", "ticket": bytes, "handle": <64 bytes>, "nbytes": int, "device": int}``,
  the ticket coming from a ``cuda_ipc`` staging handshake (no descriptor: it binds our
  credentials to the session);
* ``caller_ready()``, on the caller's thread, records an event on the caller's current torch stream:
  the copies wait for it, so they see every KV write the caller queued before ``store``/``load``;
* ``gather`` runs the gather kernel on the copier's own stream and waits for it (the PUT that
  follows must find the bytes in staging); ``scatter`` waits for the daemon's bytes (the GET reply
  came after its copy ended), scatters, and waits, so a load's future resolves after the scatter.

CuPy is imported only here and in ``kernels``, only when a GPU tensor is given.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .copies import CopyUnit, LayerPages
from .kernels import GatherScatter, KernelError, build_tables, import_cupy, unit_nbytes

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
#: An abandoned session's buffer is freed this long after, when the daemon has surely closed its
#: handle (its session timeout is 30 s by default): freed earlier, a late copy of the daemon could
#: write into memory this process has reused.
RETIRE_S = 120.0


def tables_device(tables: Sequence[Sequence[LayerPages]]) -> torch.device:
    """The one device every layer lives on (cpu or one CUDA device); ValueError otherwise."""
    devices = {layer.pages.device for layers in tables for layer in layers}
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        names = sorted(str(d) for d in devices)
        raise ValueError(f"the KV cache spans devices {names}; allowed: every layer on one device "
                         "(one client per GPU)")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the KV cache is on {device}; allowed: cpu or cuda tensors")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def staging_handle(handle: bytes, nbytes: int, device: int, pci_bus_id: str | None = None,
                   ticket: bytes = b"") -> dict:
    """The HELLO ``staging`` field of a CUDA IPC staging buffer (``ticket``: its handshake's).

    ``pci_bus_id`` lets the daemon find the same GPU when its device numbers differ from ours
    (``CUDA_VISIBLE_DEVICES``); ``device`` is the fallback.
    """
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {handle!r:.40}")
    spec = {"kind": "cuda_ipc", "ticket": bytes(ticket), "handle": bytes(handle),
            "nbytes": int(nbytes), "device": int(device)}
    if pci_bus_id:
        spec["pci_bus_id"] = pci_bus_id
    return spec


class CudaStagingBuffer:
    """``nbytes`` of device memory on ``device``, exported by a CUDA IPC handle."""

    handshake_kind = "cuda_ipc"
    fd = None  # the handshake passes no descriptor: the IPC handle goes in HELLO

    def __init__(self, nbytes: int, device: int, retire: Any = None, stream: Any = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging_bytes={nbytes}; allowed: a positive size")
        self.cupy = import_cupy()
        self.nbytes = nbytes
        self.device = device
        runtime = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(device):
            self.address = runtime.malloc(nbytes)
            try:
                self._handle = bytes(runtime.ipcGetMemHandle(self.address))
                bus = getattr(runtime, "deviceGetPCIBusId", None)
                self.pci_bus_id = bus(device) if bus is not None else None
            except BaseException:
                runtime.free(self.address)
                raise
        self._tensor: torch.Tensor | None = None
        self._retire = retire
        self._stream = stream  # the only stream that copies into or out of it (the copier's)

    def handle(self, ticket: bytes) -> dict:
        return staging_handle(self._handle, self.nbytes, self.device, self.pci_bus_id, ticket)

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a torch uint8 tensor (shares memory; the torch reference's view)."""
        if self._tensor is None:
            cp = self.cupy
            memory = cp.cuda.UnownedMemory(self.address, self.nbytes, self, self.device)
            array = cp.ndarray((self.nbytes,), dtype=cp.uint8,
                               memptr=cp.cuda.MemoryPointer(memory, 0))
            self._tensor = torch.as_tensor(array, device=f"cuda:{self.device}")
        return self._tensor

    def release_fd(self) -> None:
        """No descriptor to release (the memfd buffer's API)."""

    def close(self) -> None:
        """End of a session. The daemon may still be copying into an abandoned session's buffer
        (a timed-out request), so a copier's buffer is retired, and freed later (see ``retire``)."""
        if self._retire is not None:
            retire, self._retire = self._retire, None
            retire(self)
        else:
            self.free()

    def free(self) -> None:
        """Free the memory now: for a buffer the daemon never mapped (a refused HELLO) or no
        longer maps. Waits only for the copier's stream, never for the whole device (that would
        stall the engine's model streams)."""
        if self.address:
            self._tensor = None
            with self.cupy.cuda.Device(self.device):
                if self._stream is not None:
                    self._stream.synchronize()  # no kernel of ours may still use it
                self.cupy.cuda.runtime.free(self.address)
            self.address = 0
            self._retire = None


class CudaCopier:
    """Kernels, stream and staging buffers of one client on one GPU."""

    def __init__(self, tables: Sequence[Sequence[LayerPages]], blocks_per_chunk: Sequence[int],
                 device: torch.device) -> None:
        self.device = device.index if device.index is not None else 0
        self.kernels = GatherScatter(build_tables(tables, blocks_per_chunk), self.device)
        self.cupy = self.kernels.cupy
        with self.cupy.cuda.Device(self.device):
            self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self._retired: list[tuple[float, CudaStagingBuffer]] = []

    def new_staging(self, nbytes: int) -> CudaStagingBuffer:
        self._free_retired(time.monotonic() - RETIRE_S)
        return CudaStagingBuffer(nbytes, self.device, retire=self._retire, stream=self.stream)

    def _retire(self, staging: CudaStagingBuffer) -> None:
        self._retired.append((time.monotonic(), staging))

    def _free_retired(self, before: float) -> None:
        keep = []
        for when, staging in self._retired:
            if when <= before:
                staging.free()
            else:
                keep.append((when, staging))
        self._retired = keep

    def close(self) -> None:
        """Free every staging buffer: the client is closed (its last BYE was answered), or its
        constructor failed (no PUT or GET ever went out, so no daemon copy can target them)."""
        self._free_retired(float("inf"))

    def caller_ready(self) -> Any:
        """An event on the caller's current torch stream (call on the caller's thread)."""
        cp = self.cupy
        with cp.cuda.Device(self.device):
            caller = cp.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)
            event = cp.cuda.Event(disable_timing=True)
            event.record(caller)
        return event

    def gather(self, units: Sequence[CopyUnit], staging: CudaStagingBuffer,
               ready: Any = None) -> None:
        self._run(self.kernels.gather, units, staging, ready)

    def scatter(self, units: Sequence[CopyUnit], staging: CudaStagingBuffer,
                ready: Any = None) -> None:
        self._run(self.kernels.scatter, units, staging, ready)

    def _run(self, launch: Any, units: Sequence[CopyUnit], staging: CudaStagingBuffer,
             ready: Any) -> None:
        for unit in units:
            end = unit.staging_offset + unit_nbytes(self.kernels.tables, unit)
            if unit.staging_offset < 0 or end > staging.nbytes:
                raise ValueError(f"unit at staging offset {unit.staging_offset} ends at {end}, "
                                 f"past the {staging.nbytes}-byte staging buffer")
        with self.cupy.cuda.Device(self.device):
            if ready is not None:
                self.stream.wait_event(ready)
            launch(units, staging.address, self.stream)
            self.stream.synchronize()


__all__ = ["CudaCopier", "CudaStagingBuffer", "KernelError", "staging_handle", "tables_device"]
