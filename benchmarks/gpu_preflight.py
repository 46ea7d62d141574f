"""What only a GPU machine can tell, checked in under 30 s before anything else runs there.

``benchmarks/gpu_check.sh`` runs this first and stops with its table when a required check fails,
so a device run never spends minutes on tests whose premise is broken. Each row is one question:

* host limits: /dev/shm size (the daemon's arena lives there) and RLIMIT_MEMLOCK;
* CuPy and the device: a real CuPy (not the CPU stand-in), a visible GPU, driver and runtime;
* NVRTC: ``cuda/gather_scatter.cu`` compiles and loads as the client loads it (registers, spills);
* ``cudaHostRegister`` of an mlocked MAP_SHARED /dev/shm arena (the daemon's ``Arena``), and its
  D2H / H2D rate against a cudaHostAlloc'd buffer of the same size (CUDA events);
* CUDA IPC inside this VM: a child process exports a buffer, this one opens it, checks its size
  with ``cuMemGetAddressRange`` and its bytes; then opens the same handle a second time (what CUDA
  answers is reported: the daemon shares one mapping per handle either way);
* a D2H from that child's buffer after the child was SIGKILLed, and whether this process's context
  is still healthy afterwards (the daemon's teardown after a killed client relies on it).

Prints a table last; ``--json PATH`` saves it. Exit 0 when every required check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
GiB = 1024**3

CHILD = r"""
import sys, numpy, cupy as cp
n = int(sys.argv[1])
rt = cp.cuda.runtime
ptr = rt.malloc(n)  # a plain cudaMalloc, as the client's staging (never a pool sub-block)
host = (numpy.arange(n, dtype=numpy.uint32) * 7 + 3).astype(numpy.uint8)  # the parent checks it
rt.memcpy(ptr, host.ctypes.data, n, 1)
print(bytes(rt.ipcGetMemHandle(ptr)).hex(), n, flush=True)
sys.stdin.readline()  # parent: "exit", or SIGKILL
"""


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], str], required: bool = True) -> bool:
        started = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # every failure becomes a row, never a traceback
            detail, ok = f"{type(exc).__name__}: {exc}", False
        self.rows.append({"check": name, "ok": ok, "required": required, "detail": detail,
                          "seconds": round(time.perf_counter() - started, 2)})
        return ok

    @property
    def passed(self) -> bool:
        return all(r["ok"] for r in self.rows if r["required"])

    def table(self) -> str:
        lines = [f"{'preflight check':<34} {'result':<7} {'s':>5}  detail"]
        for r in self.rows:
            verdict = "ok" if r["ok"] else ("FAIL" if r["required"] else "warn")
            lines.append(f"{r['check']:<34} {verdict:<7} {r['seconds']:5.1f}  {r['detail']}")
        return "\n".join(lines)


def host_limits(need_bytes: int) -> str:
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / MiB:.0f} MiB"
    detail = f"/dev/shm {free / GiB:.1f} GiB free of {st.f_blocks * st.f_frsize / GiB:.1f}; " \
             f"RLIMIT_MEMLOCK {lim}"
    if free < need_bytes:
        raise RuntimeError(f"{detail}: the GPU checks need {need_bytes / GiB:.1f} GiB there (the "
                           "benchmark's arena is 4 GiB); a container needs a larger --shm-size")
    return detail


def import_cupy() -> Any:
    """CuPy, or the ImportError that ``device_info`` then reports."""
    try:
        import cupy  # noqa: PLC0415 - what is being checked
    except ImportError as exc:
        return exc
    return cupy


def device_info(cp: Any) -> str:
    if isinstance(cp, ImportError):
        raise cp
    if getattr(cp, "STANDIN", False):
        raise RuntimeError("this CuPy is the CPU stand-in of tests/helpers: nothing would be "
                           "verified (take it off PYTHONPATH)")
    count = cp.cuda.runtime.getDeviceCount()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return (f"{count} GPU(s), 0: {name}; CuPy {cp.__version__}, driver "
            f"{cp.cuda.runtime.driverGetVersion()}, runtime {cp.cuda.runtime.runtimeGetVersion()}")


def nvrtc(cp: Any) -> str:
    from kvtier_client import kernels  # noqa: PLC0415 - after sys.path is set

    module = kernels.load_module(0)
    drv = cp.cuda.driver
    parts = []
    for name in kernels.KERNELS:
        ptr = module.get_function(name).ptr
        regs = drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_NUM_REGS, ptr)
        local = drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, ptr)
        parts.append(f"{name}: {regs} registers, {local} B local (spills)")
    return "; ".join(parts)


def timed_copy(cp: Any, dst: int, src: int, nbytes: int, kind: int, reps: int = 3) -> float:
    """GB/s of the best of ``reps`` copies, timed with CUDA events on one stream."""
    stream = cp.cuda.Stream(non_blocking=True)
    best = float("inf")
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        end.record(stream)
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end))
    return nbytes / best / 1e6


def registered_arena(cp: Any, nbytes: int) -> str:
    from kvtierd.tiers.arena import Arena  # noqa: PLC0415

    arena = Arena(f"kvtierd-preflight-{os.getpid()}", nbytes, prefault=True, lock=True,
                  persistent=False)
    try:
        t0 = time.perf_counter()
        cp.cuda.runtime.hostRegister(arena.address, nbytes, 1)  # cudaHostRegisterPortable
        reg_s = time.perf_counter() - t0
        dev = cp.cuda.runtime.malloc(nbytes)
        pinned = cp.cuda.alloc_pinned_memory(nbytes)
        try:
            d2h = timed_copy(cp, arena.address, dev, nbytes, 2)
            h2d = timed_copy(cp, dev, arena.address, nbytes, 1)
            ref = timed_copy(cp, pinned.ptr, dev, nbytes, 2)
        finally:
            cp.cuda.runtime.free(dev)
            cp.cuda.runtime.hostUnregister(arena.address)
        detail = (f"{nbytes / GiB:.2f} GiB arena (mlocked={arena.locked}) registered in "
                  f"{reg_s:.2f} s; D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s, cudaHostAlloc D2H "
                  f"{ref:.1f} GB/s ({d2h / ref:.2f}x)")
        if d2h < 0.7 * ref:
            raise RuntimeError(detail + ": the registered arena is not DMA-fast")
        return detail
    finally:
        arena.close(unlink=True)


class Exporter:
    """A child process holding a device buffer it exported with cudaIpcGetMemHandle."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(nbytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def handle(self, timeout_s: float = 20.0) -> tuple[bytes, int]:
        import select  # noqa: PLC0415

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"the exporting child said nothing within {timeout_s} s")
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"the exporting child failed (exit {self.proc.poll()})")
        return bytes.fromhex(line[0]), int(line[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def expected_pattern(nbytes: int) -> bytes:
    return bytes((i * 7 + 3) & 0xFF for i in range(256)) * (nbytes // 256)


def ipc_open(cp: Any, exporter: Exporter, state: dict) -> str:
    from kvtierd import cuda_health  # noqa: PLC0415

    handle, alloc = exporter.handle()
    rt = cp.cuda.runtime
    ptr = rt.ipcOpenMemHandle(handle, 1)
    state["ptr"] = ptr
    base, size = cuda_health.allocation_range(cp, ptr)
    host = bytearray(exporter.nbytes)
    view = memoryview(host)
    addr = _address(view)
    rt.memcpy(addr, ptr, exporter.nbytes, 2)
    if bytes(host) != expected_pattern(exporter.nbytes):
        raise RuntimeError("the bytes read through the opened handle are not the child's")
    if size < exporter.nbytes or base != ptr:
        raise RuntimeError(f"cuMemGetAddressRange says [0x{base:x}, +{size}) for the opened "
                           f"0x{ptr:x}, the child allocated {alloc}")
    try:
        again = rt.ipcOpenMemHandle(handle, 1)
    except Exception as exc:  # noqa: BLE001 - reported: the daemon shares one mapping anyway
        second = f"fails ({exc})"
    else:
        if again == ptr:  # maybe not reference-counted: left open, so the next check can copy
            second = "returns the same pointer"
        else:
            rt.ipcCloseMemHandle(again)
            second = "returns another mapping"
    return (f"opened a {exporter.nbytes // MiB} MiB buffer of a child, {size} B per "
            f"cuMemGetAddressRange, bytes match; a second open of the same handle {second}")


def after_sigkill(cp: Any, exporter: Exporter, state: dict) -> str:
    rt = cp.cuda.runtime
    if not state.get("ptr"):
        raise RuntimeError("the IPC check did not open a handle")
    exporter.kill()
    host = bytearray(exporter.nbytes)
    addr = _address(memoryview(host))
    try:
        rt.memcpy(addr, state["ptr"], exporter.nbytes, 2)
        read = ("reads the child's bytes" if bytes(host) == expected_pattern(exporter.nbytes)
                else "reads other bytes")
    except Exception as exc:  # noqa: BLE001 - what CUDA does here is the question
        read = f"fails ({exc})"
    try:
        rt.ipcCloseMemHandle(state.pop("ptr"))
        closed = "closes"
    except Exception as exc:  # noqa: BLE001
        closed = f"close fails ({exc})"
    rt.memGetInfo()  # raises if this context is broken: the one failure that matters
    probe = cp.cuda.runtime.malloc(MiB)
    rt.free(probe)
    return f"after SIGKILL of the exporter a D2H {read}, the handle {closed}; context healthy"


def _address(view: memoryview) -> int:
    import ctypes  # noqa: PLC0415

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arena-gib", type=int, default=1)
    parser.add_argument("--ipc-mib", type=int, default=64)
    parser.add_argument("--shm-need-gib", type=float, default=4.5,
                        help="free /dev/shm the checks need (gpu_transfer.py's 4 GiB arena)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    checks = Checks()
    checks.run("host: /dev/shm and RLIMIT_MEMLOCK", lambda: host_limits(
        int(args.shm_need_gib * GiB)))
    cp = import_cupy()
    if not checks.run("CuPy and a GPU", lambda: device_info(cp)):
        return finish(checks, args.json)
    exporter = Exporter(args.ipc_mib * MiB)  # starts while NVRTC compiles
    state: dict = {}
    try:
        checks.run("NVRTC: gather_scatter.cu loads", lambda: nvrtc(cp))
        checks.run("cudaHostRegister of a /dev/shm arena", lambda: registered_arena(
            cp, args.arena_gib * GiB))
        checks.run("CUDA IPC open in this VM", lambda: ipc_open(cp, exporter, state))
        checks.run("D2H after the client's SIGKILL", lambda: after_sigkill(cp, exporter, state))
    finally:
        exporter.kill()
    return finish(checks, args.json)


def finish(checks: Checks, path: Path | None) -> int:
    print("\n" + checks.table())
    print(f"preflight: {'PASS' if checks.passed else 'FAIL'}")
    if path is not None:
        path.write_text(json.dumps({"passed": checks.passed, "rows": checks.rows}, indent=1))
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
