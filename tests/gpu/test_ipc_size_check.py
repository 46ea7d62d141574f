"""On a GPU: the daemon sizes a CUDA IPC staging buffer with the driver (cuMemGetAddressRange) and
refuses an announced nbytes above the allocation; an honest one round-trips byte for byte."""

from __future__ import annotations

import random

from helpers.cuda_ipc import cuda_ipc_hello, cuda_ipc_spec
from helpers.wait import wait_for
from kvtierd.protocol import Op, Status

ALLOC = 1 << 20
POISON = 0xAB


def test_announced_size_above_the_allocation_is_refused(daemon_factory):
    import cupy as cp  # noqa: PLC0415 - only where the gpu marker lets this run

    daemon = daemon_factory()
    rt = cp.cuda.runtime
    with cp.cuda.Device(0):
        ptr = rt.malloc(ALLOC)  # a plain cudaMalloc, like the client's staging
        bus = rt.deviceGetPCIBusId(0)
    try:
        handle = bytes(rt.ipcGetMemHandle(ptr))
        raw, reply = cuda_ipc_hello(daemon.address, cuda_ipc_spec(handle, 4 * ALLOC, 0, bus))
        raw.close()
        print(f"oversized HELLO: {reply}")
        assert reply["name"] == "BAD_HANDLE", reply
        assert "larger than the" in reply["message"] and "device allocation" in reply["message"]
        assert daemon.stats()["cuda"]["open_handles"] == 0

        data = random.Random(5).randbytes(ALLOC // 2)
        host = cp.cuda.alloc_pinned_memory(ALLOC)
        rt.memcpy(ptr, _fill(host, data), len(data), 1)
        raw, reply = cuda_ipc_hello(daemon.address, cuda_ipc_spec(handle, ALLOC, 0, bus))
        assert reply["name"] == "OK", reply
        put, _ = raw.request(Op.PUT, items=[[b"k", 0, len(data)]])
        assert put["results"] == [Status.OK], put
        rt.memset(ptr, POISON, ALLOC)
        got, _ = raw.request(Op.GET, items=[[b"k", ALLOC // 2, len(data)]])
        assert got["results"] == [Status.OK], got
        back = bytearray(ALLOC)
        rt.memcpy(_address(back), ptr, ALLOC, 2)
        assert bytes(back[ALLOC // 2:]) == data
        assert bytes(back[:ALLOC // 2]) == bytes([POISON]) * (ALLOC // 2)
        raw.request(Op.BYE)
        raw.close()
        wait_for(lambda: daemon.stats()["cuda"]["open_handles"] == 0, 30, "handle closed")
        assert daemon.stats()["cuda"]["lost"] == {}
    finally:
        rt.free(ptr)


def _fill(host, data: bytes) -> int:
    """Copy ``data`` into pinned ``host`` memory; its address."""
    import ctypes  # noqa: PLC0415

    ctypes.memmove(host.ptr, data, len(data))
    return host.ptr


def _address(buf: bytearray) -> int:
    import ctypes  # noqa: PLC0415

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
