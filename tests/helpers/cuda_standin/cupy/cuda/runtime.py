"""CPU stand-in (see ../../README.md) for ``cupy.cuda.runtime``: memory, IPC and copies.

"Device memory" is a memfd mapped here; its handle names ``(pid, fd, size)`` and another process
maps the same memfd through ``/proc/<pid>/fd/<fd>``. A copy whose device side leaves every
allocation and opened handle breaks the context with cudaErrorIllegalAddress, which is sticky:
every later call fails with it, as on a GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading

HANDLE_MAGIC = b"KVTSTDIN"
HANDLE_BYTES = 64
ILLEGAL_ADDRESS = 700
INVALID_VALUE = 1
INVALID_DEVICE = 101
INVALID_HANDLE = 400  # cudaErrorInvalidResourceHandle
FAULT_ENV = "KVTIER_CUDA_STANDIN_FAULT_AFTER"
DEVICES_ENV = "KVTIER_CUDA_STANDIN_DEVICES"
NAMES = {1: "cudaErrorInvalidValue", 101: "cudaErrorInvalidDevice",
         400: "cudaErrorInvalidResourceHandle", 700: "cudaErrorIllegalAddress"}

cudaIpcMemLazyEnablePeerAccess = 1


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int, detail: str = "") -> None:
        super().__init__(f"{NAMES.get(status, 'cudaError')}: {detail or 'stand-in error'}")
        self.status = status


class _Region:
    def __init__(self, mm: mmap.mmap, fd: int | None, size: int) -> None:
        self.mm = mm
        self.fd = fd  # kept open for allocations: their handle names it
        self.size = size
        self.anchor = ctypes.c_char.from_buffer(mm)
        self.address = ctypes.addressof(self.anchor)

    def close(self) -> None:
        del self.anchor
        self.mm.close()
        if self.fd is not None:
            os.close(self.fd)


_lock = threading.Lock()
_allocations: dict[int, _Region] = {}
_opened: dict[int, _Region] = {}
_registered: dict[int, int] = {}
_state = {"broken": 0, "copies": 0, "device": 0}
calls = {"deviceSynchronize": 0}  # what tests check was (not) called


def _check_context() -> None:
    if _state["broken"]:
        raise CUDARuntimeError(_state["broken"], "the context faulted earlier (sticky)")


def _region(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """``(base, size)`` of the allocation or opened handle holding ``[ptr, ptr + nbytes)``."""
    with _lock:
        for region in (*_allocations.values(), *_opened.values()):
            if region.address <= ptr and ptr + nbytes <= region.address + region.size:
                return region.address, region.size
    return None


def allocated_bytes() -> int:
    """Bytes of "device memory" this process allocated and has not freed (tests read it)."""
    with _lock:
        return sum(r.size for r in _allocations.values())


def getDeviceCount() -> int:
    return int(os.environ.get(DEVICES_ENV, "1"))


def getDevice() -> int:
    return _state["device"]


def setDevice(device: int) -> None:
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError(INVALID_DEVICE, f"device {device}")
    _state["device"] = device


def deviceGetPCIBusId(device: int) -> str:
    return f"0000:{device + 0x10:02x}:00.0"


def deviceGetByPCIBusId(bus: str) -> int:
    for device in range(getDeviceCount()):
        if deviceGetPCIBusId(device) == bus.lower():
            return device
    raise CUDARuntimeError(INVALID_DEVICE, f"no device with PCI bus id {bus}")


def memGetInfo() -> tuple[int, int]:
    _check_context()
    return 1 << 34, 1 << 34


def malloc(nbytes: int) -> int:
    _check_context()
    fd = os.memfd_create("kvtier-cuda-standin", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    region = _Region(mmap.mmap(fd, nbytes), fd, nbytes)
    with _lock:
        _allocations[region.address] = region
    return region.address


def free(ptr: int) -> None:
    _check_context()
    with _lock:
        region = _allocations.pop(ptr, None)
    if region is None:
        raise CUDARuntimeError(INVALID_VALUE, f"free of 0x{ptr:x}, not an allocation")
    region.close()


def ipcGetMemHandle(ptr: int) -> bytes:
    _check_context()
    with _lock:
        region = _allocations.get(ptr)
    if region is None:
        raise CUDARuntimeError(INVALID_VALUE, f"0x{ptr:x} is not an allocation's base")
    body = HANDLE_MAGIC + struct.pack("<iiQ", os.getpid(), region.fd, region.size)
    return body.ljust(HANDLE_BYTES, b"\0")


def ipcOpenMemHandle(handle: bytes, flags: int = cudaIpcMemLazyEnablePeerAccess) -> int:
    _check_context()
    if len(handle) != HANDLE_BYTES or not handle.startswith(HANDLE_MAGIC):
        raise CUDARuntimeError(INVALID_HANDLE, "not a handle of this stand-in")
    pid, fd, size = struct.unpack_from("<iiQ", handle, len(HANDLE_MAGIC))
    if pid == os.getpid():
        raise CUDARuntimeError(INVALID_HANDLE, "a handle cannot be opened in its own process")
    try:
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise CUDARuntimeError(INVALID_HANDLE, f"the exporting process is gone ({exc})") from None
    try:
        if os.fstat(local).st_size < size:
            raise CUDARuntimeError(INVALID_HANDLE, "the allocation is smaller than its handle")
        region = _Region(mmap.mmap(local, size), None, size)
    finally:
        os.close(local)
    with _lock:
        _opened[region.address] = region
    return region.address


def ipcCloseMemHandle(ptr: int) -> None:
    _check_context()
    with _lock:
        region = _opened.pop(ptr, None)
    if region is None:
        raise CUDARuntimeError(INVALID_VALUE, f"0x{ptr:x} is not an opened handle")
    region.close()


def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    """A memmove after the checks a GPU's MMU would make of the device side (kind 1 H2D,
    2 D2H, 3 D2D); a copy outside every region, or the injected fault, breaks the context."""
    _check_context()
    device_side = {1: (dst,), 2: (src,), 3: (dst, src)}.get(kind)
    if device_side is None:
        raise CUDARuntimeError(INVALID_VALUE, f"memcpy kind {kind}")
    with _lock:
        _state["copies"] += 1
        fault_after = os.environ.get(FAULT_ENV)
        injected = fault_after is not None and _state["copies"] > int(fault_after)
    if injected or any(_region(ptr, nbytes) is None for ptr in device_side):
        _state["broken"] = ILLEGAL_ADDRESS
        how = " (injected)" if injected else ""
        raise CUDARuntimeError(ILLEGAL_ADDRESS, f"copy of {nbytes} bytes at "
                               f"0x{device_side[0]:x} faulted{how}")
    ctypes.memmove(dst, src, nbytes)


def memcpy(dst: int, src: int, nbytes: int, kind: int) -> None:
    memcpyAsync(dst, src, nbytes, kind, 0)


def memset(ptr: int, value: int, nbytes: int) -> None:
    _check_context()
    if _region(ptr, nbytes) is None:
        _state["broken"] = ILLEGAL_ADDRESS
        raise CUDARuntimeError(ILLEGAL_ADDRESS, f"memset of {nbytes} bytes at 0x{ptr:x} faulted")
    ctypes.memset(ptr, value, nbytes)


def hostRegister(ptr: int, nbytes: int, flags: int) -> None:
    _check_context()
    _registered[ptr] = nbytes


def hostUnregister(ptr: int) -> None:
    _check_context()
    if _registered.pop(ptr, None) is None:
        raise CUDARuntimeError(INVALID_VALUE, f"0x{ptr:x} is not registered")


def deviceSynchronize() -> None:
    _check_context()
    calls["deviceSynchronize"] += 1


def streamSynchronize(stream: int) -> None:
    _check_context()
