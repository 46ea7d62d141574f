"""What the daemon asks the CUDA driver before and after trusting a client's device memory.

Two checks guard every GPU on the node, because the daemon's CUDA context on a device is shared by
every session there:

* ``allocation_range(cupy, ptr)``: ``cuMemGetAddressRange`` of an opened IPC pointer, the real size
  of the allocation the handle names. A client that announces more ``nbytes`` than that would make
  the daemon DMA past the mapping. CuPy 14 has no binding for this call, so it goes through ctypes
  on ``libcuda.so.1``; a CuPy-like module that offers ``cuda.driver.memGetAddressRange`` (the CPU
  stand-in in ``tests/helpers/cuda_standin``) is asked instead.
* ``note_failure(cupy, device, exc)``: after a failed CUDA call, whether the device's context is
  broken for good (a *sticky* error such as cudaErrorIllegalAddress: every later call in the process
  fails the same way). Then the device is recorded as lost: no copy is attempted on it any more, the
  daemon answers what is in flight with an error and exits for its supervisor (systemd
  ``Restart=on-failure``, a Kubernetes restart) to start it with a fresh context. It never serves
  on silently.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

#: cudaError_t values after which a CUDA context is unusable until the process exits: a kernel or
#: DMA faulted (illegal address/instruction, misaligned or invalid address space, hardware stack
#: error, assert, launch failure or timeout), the ECC saw an uncorrectable error, or the context is
#: gone. (CUDA Runtime API, "Error Handling": these are the errors documented as sticky.)
STICKY_ERRORS = {
    214: "cudaErrorECCUncorrectable",
    700: "cudaErrorIllegalAddress",
    702: "cudaErrorLaunchTimeout",
    709: "cudaErrorContextIsDestroyed",
    710: "cudaErrorAssert",
    714: "cudaErrorHardwareStackError",
    715: "cudaErrorIllegalInstruction",
    716: "cudaErrorMisalignedAddress",
    717: "cudaErrorInvalidAddressSpace",
    718: "cudaErrorInvalidPc",
    719: "cudaErrorLaunchFailure",
}

#: The exit status of ``kvtierd serve`` after a lost CUDA context (EX_TEMPFAIL: restart it).
EXIT_CUDA_CONTEXT_LOST = 75


class CudaContextLost(RuntimeError):
    """A device's CUDA context hit a sticky error: nothing more may be copied on it."""


class DriverError(RuntimeError):
    """A CUDA driver call failed (its CUresult and name are in the message)."""


_lost: dict[int, str] = {}
_lost_lock = threading.Lock()


def lost() -> dict[int, str]:
    """Devices whose context was lost, with the reason (empty while all is well)."""
    with _lost_lock:
        return dict(_lost)


def any_lost() -> bool:
    """Whether any device's context was lost (the request loop asks this every turn)."""
    return bool(_lost)


def check_device(device: int) -> None:
    """Raise ``CudaContextLost`` if ``device``'s context was lost earlier."""
    reason = _lost.get(device)
    if reason is not None:
        raise CudaContextLost(f"the CUDA context on device {device} was lost earlier ({reason}); "
                              "the daemon is restarting")


def note_failure(cupy: Any, device: int, exc: BaseException) -> CudaContextLost | None:
    """Classify a failed CUDA call on ``device``: a ``CudaContextLost`` to raise when the error is
    sticky (the device is then recorded as lost), or None when only that call failed."""
    status = getattr(exc, "status", None)
    name = STICKY_ERRORS.get(status) if isinstance(status, int) else None
    if name is None and not _probe_fails(cupy, device):
        return None
    reason = f"{name} ({status})" if name else f"{exc} (and the context no longer answers)"
    with _lost_lock:
        first = device not in _lost
        _lost.setdefault(device, reason)
    if first:
        log.critical("CUDA context on device %d lost: %s; refusing every copy on it and exiting "
                     "for a restart", device, reason)
    return CudaContextLost(f"the CUDA context on device {device} is lost ({reason}); the daemon "
                           "is restarting")


def _probe_fails(cupy: Any, device: int) -> bool:
    """Whether a harmless call on ``device`` fails too (a sticky error not in our table)."""
    try:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.memGetInfo()
    except Exception:  # CUDARuntimeError: the context answers every call with its error
        return True
    return False


def allocation_range(cupy: Any, ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation holding ``ptr`` (current device's context)."""
    binding = getattr(cupy.cuda.driver, "memGetAddressRange", None)
    if binding is not None:
        try:
            return binding(ptr)
        except Exception as exc:  # CUDADriverError
            raise DriverError(f"cuMemGetAddressRange(0x{ptr:x}) failed: {exc}") from None
    fn = _cu_mem_get_address_range()
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    result = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if result != 0:
        raise DriverError(f"cuMemGetAddressRange(0x{ptr:x}) failed: CUresult {result} "
                          f"({_error_name(result)})")
    return base.value, size.value


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DriverError(f"cannot load libcuda.so.1 for cuMemGetAddressRange ({exc})") from None


@functools.lru_cache(maxsize=1)
def _cu_mem_get_address_range() -> Any:
    fn = _libcuda().cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def _error_name(result: int) -> str:
    try:
        fn = _libcuda().cuGetErrorName
    except (DriverError, AttributeError):
        return "unknown"
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    fn.restype = ctypes.c_int
    name = ctypes.c_char_p()
    if fn(result, ctypes.byref(name)) != 0 or not name.value:
        return "unknown"
    return name.value.decode()
