"""The CUDA IPC control path of a real daemon, run on the CPU stand-in for CuPy
(``tests/helpers/cuda_standin``): HELLO with a ``cuda_ipc`` spec, handle open/close, the allocation
size check, the copy plan, sticky-error exit, teardown after a SIGKILL, and the client freeing its
staging on a refused HELLO. This is control-flow coverage on every CI run, NOT GPU verification
(``benchmarks/gpu_check.sh`` is that)."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.cuda_standin.cupy.cuda import runtime as standin
from helpers.cuda_ipc import cuda_ipc_hello, cuda_ipc_spec
from helpers.kv import simple_layout
from helpers.standin import use_standin_cupy
from helpers.wait import wait_for
from kvtier_client import KVTierClient
from kvtier_client import client as client_module
from kvtier_client.handshake import HandshakeError
from kvtier_client.transport import DaemonError
from kvtierd.cuda_health import EXIT_CUDA_CONTEXT_LOST
from kvtierd.protocol import Op, Status

STANDIN_DIR = Path(__file__).parents[1] / "helpers" / "cuda_standin"
BUFFER = 4 << 20
POISON = 0xAB


def standin_env(**extra: str) -> dict:
    """A daemon whose ``import cupy`` finds the stand-in; its copy threads must sleep on events."""
    path = os.pathsep.join(p for p in (str(STANDIN_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "KVTIER_CUDA_STANDIN_STRICT_EVENTS": "1", **extra}


class DeviceBuffer:
    """Stand-in "device memory" of this process, exported by a stand-in IPC handle."""

    def __init__(self, nbytes: int = BUFFER) -> None:
        self.nbytes = nbytes
        self.address = standin.malloc(nbytes)
        self.handle = standin.ipcGetMemHandle(self.address)

    def spec(self, nbytes: int | None = None) -> dict:
        return cuda_ipc_spec(self.handle, self.nbytes if nbytes is None else nbytes, 0,
                             standin.deviceGetPCIBusId(0))

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.address + offset, data, len(data))

    def read(self, offset: int, nbytes: int) -> bytes:
        return ctypes.string_at(self.address + offset, nbytes)

    def free(self) -> None:
        standin.free(self.address)


@pytest.fixture
def device_buffer():
    buf = DeviceBuffer()
    yield buf
    buf.free()


def payloads(rng: random.Random, sizes: list[int]) -> list[bytes]:
    return [rng.randbytes(n) for n in sizes]


def test_roundtrip_through_an_ipc_handle_is_byte_exact(daemon_factory, device_buffer):
    daemon = daemon_factory(env=standin_env())
    rng = random.Random(14)
    sizes = [200_000, 65_536, 333_333, 1]
    datas = payloads(rng, sizes)
    offsets = [0, 256 << 10, 512 << 10, 1 << 20]
    raw, reply = cuda_ipc_hello(daemon.address, device_buffer.spec())
    assert reply["name"] == "OK", reply
    assert daemon.stats()["cuda"]["open_handles"] == 1
    assert daemon.stats()["cuda"]["lost"] == {}
    for off, data in zip(offsets, datas):
        device_buffer.write(off, data)
    keys = [f"chunk-{i}".encode() for i in range(len(sizes))]
    put, _ = raw.request(Op.PUT, items=[[k, o, n] for k, o, n in zip(keys, offsets, sizes)])
    assert put["results"] == [Status.OK] * len(sizes), put
    device_buffer.write(0, bytes([POISON]) * BUFFER)
    targets = [(2 << 20) + off for off in offsets]
    got, _ = raw.request(Op.GET, items=[[k, t, n] for k, t, n in zip(keys, targets, sizes)])
    assert got["results"] == [Status.OK] * len(sizes), got
    for target, data in zip(targets, datas):
        assert device_buffer.read(target, len(data)) == data
        assert device_buffer.read(target + len(data), 1) == bytes([POISON])
    assert device_buffer.read(0, 2 << 20) == bytes([POISON]) * (2 << 20)  # nothing else written
    out, _ = raw.request(Op.GET, items=[[keys[0], BUFFER - 10, 200_000]])
    assert out["results"] == [Status.OUT_OF_BOUNDS], out
    raw.request(Op.BYE)
    raw.close()
    wait_for(lambda: daemon.stats()["cuda"]["open_handles"] == 0, 10, "handle closed after BYE")
    pinning = wait_for(lambda: daemon.stats()["cuda"]["pinning"]["state"] != "pinning" and
                       daemon.stats()["cuda"]["pinning"], 10, "pinning ended")
    assert pinning["state"] == "ready", pinning


def test_announced_size_above_the_allocation_is_refused(daemon_factory, device_buffer):
    daemon = daemon_factory(env=standin_env())
    raw, reply = cuda_ipc_hello(daemon.address, device_buffer.spec(BUFFER + 1))
    assert reply["name"] == "BAD_HANDLE", reply
    assert f"staging nbytes {BUFFER + 1} is larger than the {BUFFER}-byte device allocation" in \
        reply["message"]
    assert daemon.stats()["cuda"]["open_handles"] == 0
    raw.close()
    # the same handle, honestly announced (smaller is fine), still opens
    raw, reply = cuda_ipc_hello(daemon.address, device_buffer.spec(BUFFER // 2))
    assert reply["name"] == "OK", reply
    out, _ = raw.request(Op.PUT, items=[[b"k", BUFFER // 2 - 8, 16]])
    assert out["results"] == [Status.OUT_OF_BOUNDS], out
    raw.close()
    assert "Traceback" not in daemon.log()


def test_one_handle_in_two_sessions_shares_one_mapping(daemon_factory, device_buffer):
    daemon = daemon_factory(env=standin_env())
    data = random.Random(3).randbytes(100_000)
    device_buffer.write(0, data)
    first, r1 = cuda_ipc_hello(daemon.address, device_buffer.spec())
    second, r2 = cuda_ipc_hello(daemon.address, device_buffer.spec())
    assert r1["name"] == r2["name"] == "OK", (r1, r2)
    assert first.request(Op.PUT, items=[[b"a", 0, len(data)]])[0]["results"] == [Status.OK]
    first.request(Op.BYE)  # must not unmap the buffer the second session still copies through
    first.close()
    device_buffer.write(0, bytes([POISON]) * len(data))
    got, _ = second.request(Op.GET, items=[[b"a", 1 << 20, len(data)]])
    assert got["results"] == [Status.OK], got
    assert device_buffer.read(1 << 20, len(data)) == data
    assert daemon.stats()["cuda"]["open_handles"] == 1
    second.request(Op.BYE)
    second.close()
    wait_for(lambda: daemon.stats()["cuda"]["open_handles"] == 0, 10, "handle closed")


def test_a_sticky_cuda_error_answers_and_exits_for_a_restart(daemon_factory, device_buffer):
    daemon = daemon_factory(env=standin_env(KVTIER_CUDA_STANDIN_FAULT_AFTER="1"))
    rng = random.Random(7)
    raw, reply = cuda_ipc_hello(daemon.address, device_buffer.spec())
    assert reply["name"] == "OK", reply
    device_buffer.write(0, rng.randbytes(8192))
    ok, _ = raw.request(Op.PUT, items=[[b"first", 0, 4096]])  # one DMA: the last that works
    assert ok["results"] == [Status.OK], ok
    lost, _ = raw.request(Op.PUT, items=[[b"second", 4096, 4096]])
    assert lost["results"] == [Status.SHUTTING_DOWN], lost
    assert "CUDA context on device 0 is lost (cudaErrorIllegalAddress (700))" in \
        lost["errors"][0][2]
    raw.close()
    assert daemon.proc.wait(timeout=30) == EXIT_CUDA_CONTEXT_LOST, daemon.log()
    log = daemon.log()
    assert "CRITICAL" in log and "exiting for the supervisor to restart kvtierd" in log, log
    assert not Path(f"/dev/shm/{daemon.arena_name}").exists(), "arena left behind"


KILLED_CLIENT = textwrap.dedent(r"""
    import ctypes, random, sys
    sys.path.insert(0, sys.argv[2])
    from helpers.cuda_standin.cupy.cuda import runtime as rt
    from helpers.cuda_ipc import cuda_ipc_hello, cuda_ipc_spec
    from kvtierd.protocol import Op
    ptr = rt.malloc(4 << 20)
    spec = cuda_ipc_spec(rt.ipcGetMemHandle(ptr), 4 << 20)
    raw, reply = cuda_ipc_hello(sys.argv[1], spec, namespace="killed")
    assert reply["name"] == "OK", reply
    ctypes.memmove(ptr, random.randbytes(1 << 20), 1 << 20)
    print("ready", flush=True)
    i = 0
    while True:
        raw.request(Op.PUT, items=[[b"k%d" % i, 0, 1 << 20]])
        raw.request(Op.GET, items=[[b"k%d" % i, 2 << 20, 1 << 20]])
        i += 1
        if i == 3:
            print("round trips", flush=True)
""")


def test_a_sigkilled_client_leaves_no_open_handle(daemon_factory, tmp_path, device_buffer):
    daemon = daemon_factory(env=standin_env())
    script = tmp_path / "client.py"
    script.write_text(KILLED_CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), daemon.address,
                             str(Path(__file__).parents[1])], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert proc.stdout.readline().strip() == b"round trips"  # killed among them
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    wait_for(lambda: daemon.stats()["cuda"]["open_handles"] == 0, 30, "handle closed")
    assert daemon.stats()["sessions"] == 0
    daemon.check()
    raw, reply = cuda_ipc_hello(daemon.address, device_buffer.spec())  # and it still serves
    assert reply["name"] == "OK", reply
    raw.close()


@pytest.fixture
def standin_cupy_here(monkeypatch):
    """This process's ``import cupy`` gets the stand-in, and the client takes its CUDA path for
    CPU tensors (the only thing replaced: which device the KV cache is on)."""
    use_standin_cupy(monkeypatch)
    monkeypatch.setattr(client_module, "tables_device", lambda tables: torch.device("cuda", 0))
    before = standin.allocated_bytes()
    yield
    assert standin.allocated_bytes() == before


REFUSALS = {  # daemon env, client token, what the client raises, its status name
    "daemon-without-cuda": ({}, "", DaemonError, "BAD_HANDLE"),
    "auth-failed": ({**standin_env(), "KVTIERD_AUTH_TOKEN": "right"}, "wrong", DaemonError,
                    "AUTH_FAILED"),
    "handshake-refused": ({**standin_env(), "KVTIERD_MAX_STAGING_BYTES": "4MiB"}, "",
                          HandshakeError, "BAD_HANDLE"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_hello_frees_the_device_staging_at_once(daemon_factory, standin_cupy_here, case):
    env, token, error, name = REFUSALS[case]
    daemon = daemon_factory(env=env)
    layout = simple_layout(page_bytes=4096, layers=2)
    kv = {n: torch.randint(0, 256, (16, 4096), dtype=torch.uint8) for n in
          layout.groups[0].layer_names}
    before = standin.allocated_bytes()
    for _ in range(3):  # the vLLM worker retries every retry_s: nothing may pile up
        with pytest.raises(error) as err:
            KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv,
                                 staging_bytes=8 << 20, token=token)
        assert name in str(err.value), err.value
        assert standin.allocated_bytes() == before, "staging buffer leaked on a refused HELLO"
    assert daemon.stats()["sessions"] == 0


def test_a_refused_re_greeting_frees_its_new_staging_at_once(daemon_factory, standin_cupy_here):
    """A live client whose daemon restarted (now with an auth token it lacks) greets it again on
    its next call: that refused HELLO's buffer goes at once; only the old session's is retired."""
    daemon = daemon_factory(env=standin_env())
    layout = simple_layout(page_bytes=4096, layers=2)
    kv = {n: torch.randint(0, 256, (16, 4096), dtype=torch.uint8) for n in
          layout.groups[0].layer_names}
    chunks = layout.plan(list(range(64)), [list(range(4))], trim_sliding_window=False)
    before = standin.allocated_bytes()
    client = KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv,
                                  staging_bytes=8 << 20)
    try:
        assert client.lookup(chunks) == [False] * len(chunks)
        daemon.kill9()
        daemon.env["KVTIERD_AUTH_TOKEN"] = "right"
        daemon.restart()
        with pytest.raises(DaemonError, match="AUTH_FAILED"):
            client.lookup(chunks)
        # the first session's buffer is retired (its daemon might have been copying), the
        # refused one is not kept at all
        assert standin.allocated_bytes() == before + (8 << 20)
    finally:
        client.close()
    assert standin.allocated_bytes() == before
