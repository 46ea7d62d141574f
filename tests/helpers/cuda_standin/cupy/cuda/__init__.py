"""CPU stand-in (see ../../README.md) for ``cupy.cuda``: devices, streams, events, modules.

Copies run synchronously in ``runtime.memcpyAsync``, so streams and events only check the context.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import time

from . import compiler, driver, runtime

#: Set in a process whose host waits must sleep (the daemon's copy threads): waiting on an event
#: made without ``block=True`` then raises instead of spinning.
STRICT_EVENTS_ENV = "KVTIER_CUDA_STANDIN_STRICT_EVENTS"

_ptrs = itertools.count(0x1000, 0x10)


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device
        self._previous: list[int] = []

    def __enter__(self) -> Device:
        self._previous.append(runtime.getDevice())
        runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        runtime.setDevice(self._previous.pop())


class Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        runtime._check_context()
        self.ptr = 0 if null else next(_ptrs)
        self.device = runtime.getDevice()
        self.synchronized = 0  # tests check who waited for what

    def synchronize(self) -> None:
        runtime._check_context()
        self.synchronized += 1

    def wait_event(self, event: Event) -> None:
        runtime._check_context()


class ExternalStream(Stream):
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        self.ptr = ptr
        self.device = device_id
        self.synchronized = 0


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        runtime._check_context()
        self.block = block
        self.disable_timing = disable_timing

    def record(self, stream: Stream | None = None) -> None:
        runtime._check_context()
        self.time = time.perf_counter()  # copies are synchronous: "when the stream got here"

    def synchronize(self) -> None:
        runtime._check_context()
        if not self.block and os.environ.get(STRICT_EVENTS_ENV):
            raise RuntimeError("a host wait on a non-blocking event spins a CPU core "
                               f"({STRICT_EVENTS_ENV} is set: use Event(block=True))")


class PinnedMemoryPointer:
    """Host memory (``alloc_pinned_memory``): an anonymous mapping, ``ptr`` its address."""

    def __init__(self, nbytes: int) -> None:
        self._mm = mmap.mmap(-1, nbytes)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.ptr = ctypes.addressof(self._anchor)
        self.size = nbytes


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events (host time: the stand-in's copies are
    synchronous; nothing measured here says anything about a GPU)."""
    return (end.time - start.time) * 1000


def alloc_pinned_memory(nbytes: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(nbytes)


class _Function:
    def __init__(self, name: str) -> None:
        self.name = name
        self.device = runtime.getDevice()  # the device current at get_function (a GPU binds it)

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"the CPU stand-in has no kernels ({self.name}); the GPU "
                                  "runs them, tests/unit/cuda checks their code on the host")


class RawModule:
    def __init__(self, code: str = "", options: tuple = (), name_expressions: object = None,
                 **kwargs: object) -> None:
        self.code = code

    def get_function(self, name: str) -> _Function:
        runtime._check_context()
        if f"void {name}(" not in self.code and f" {name}(" not in self.code:
            raise driver.CUDADriverError(500, f"no kernel named {name} (CUDA_ERROR_NOT_FOUND)")
        return _Function(name)


__all__ = ["Device", "Event", "ExternalStream", "PinnedMemoryPointer", "RawModule", "Stream",
           "alloc_pinned_memory", "compiler", "driver", "get_elapsed_time", "runtime"]
