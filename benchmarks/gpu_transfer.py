"""GPU path throughput, each number beside its ceiling or peer measured in the same run.

1. gather / scatter kernels (paged KV cache <-> device staging) vs a device-to-device copy of the
   same bytes (target >= 0.8x), timed with CUDA events on the copy stream around multi-GiB batches
   (so the ~0.1 ms of Python per launch stays small against the copy);
2. offload (gather + D2H into the daemon's pinned arena through CUDA IPC, checksum included) and
   load (H2D + scatter, every chunk asserted a hit, the bytes checked after a poison) end to end
   through a real ``kvtierd serve``, vs one plain pinned cudaMemcpy of the same bytes (events;
   target >= 0.85x);
3. the daemon's GPU memory (nvidia-smi) before the first HELLO (its context and pinning) and after
   the traffic (plus what the IPC mappings and its stream take).

The "per-page cudaMemcpyAsync (Python loop)" rows issue one CuPy call per page from Python: they
show what a per-page copy costs when driven from Python (call overhead dominates), not vLLM's C++
``swap_blocks`` loop, and have no target.

GB/s count payload bytes once (not read + write). Prints a table last; ``--json PATH`` saves it.
Needs a GPU, CuPy and kvtierd's dependencies (see benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kvtier_client import KVGroup, KVLayout, KVTierClient  # noqa: E402
from kvtier_client.copies import CopyUnit, build_page_tables  # noqa: E402
from kvtier_client.cuda_staging import CudaCopier  # noqa: E402
from kvtierd.control import DaemonUnavailable, call  # noqa: E402
from kvtierd.protocol import Op  # noqa: E402

GiB = 1024**3
PYTHON_LOOP = "per-page memcpy (Python)"


def layout_and_cache(layers: int, page: int, blocks: int, bpc: int):
    """vLLM-like: per layer one [blocks, 2 (K/V), page] tensor; K and V are two layers' views."""
    names = [f"l{i}.{kv}" for i in range(layers) for kv in "kv"]
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=page,
                                      layer_names=tuple(names))],
                      blocks_per_chunk=bpc, tokens_per_hash=16, model="bench", dtype="bfloat16")
    kv = {}
    for i in range(layers):
        t = torch.randint(0, 256, (blocks, 2, page), dtype=torch.uint8, device="cuda")
        kv[f"l{i}.k"], kv[f"l{i}.v"] = t[:, 0], t[:, 1]
    return layout, kv


def time_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median host milliseconds of ``fn`` (end to end: the daemon round trip included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return times[len(times) // 2]


def event_ms(fn, stream, reps: int, warmup: int = 2) -> float:
    """Median milliseconds between CUDA events recorded on ``stream`` around ``fn`` (which
    enqueues its work on ``stream``): device time, not the host's wake-up latency."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    times.sort()
    return times[len(times) // 2]


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def per_page_copy(pages, staging_or_host: int, kind: int, to_cache: bool, stream) -> None:
    """One cudaMemcpyAsync per page, issued from Python (see the module docstring)."""
    memcpy = cp.cuda.runtime.memcpyAsync
    for i, (ptr, n) in enumerate(pages):
        other = staging_or_host + i * n
        if to_cache:
            memcpy(ptr, other, n, kind, stream.ptr)
        else:
            memcpy(other, ptr, n, kind, stream.ptr)


def kernel_rows(args, results):
    layout, kv = layout_and_cache(args.layers, args.page, args.blocks, args.bpc)
    tables = build_page_tables(layout, kv)
    copier = CudaCopier(tables, layout.blocks_per_chunk, torch.device("cuda", 0))
    chunk = layout.chunk_nbytes(0)
    units = [CopyUnit(0, tuple(range(u * args.bpc, (u + 1) * args.bpc)), u * chunk)
             for u in range(args.blocks // args.bpc)]
    nbytes = chunk * len(units)
    staging = copier.new_staging(nbytes)
    other = cp.cuda.runtime.malloc(nbytes)
    stream = copier.stream
    d2d = event_ms(lambda: cp.cuda.runtime.memcpyAsync(other, staging.address, nbytes, 3,
                                                      stream.ptr), stream, 10)
    g = event_ms(lambda: copier.gather(units, staging), stream, 10)
    s = event_ms(lambda: copier.scatter(units, staging), stream, 10)
    pages = [(layer.pages[b].data_ptr(), args.page) for u in units for layer in tables[0]
             for b in u.block_ids][:args.python_pages]
    page_bytes = sum(n for _, n in pages)
    vg = event_ms(lambda: per_page_copy(pages, staging.address, 3, False, stream), stream, 3, 1)
    vs = event_ms(lambda: per_page_copy(pages, staging.address, 3, True, stream), stream, 3, 1)
    results += [
        ("gather kernel", gbps(nbytes, g), "D2D copy", gbps(nbytes, d2d), 0.8),
        ("scatter kernel", gbps(nbytes, s), "D2D copy", gbps(nbytes, d2d), 0.8),
        ("gather kernel", gbps(nbytes, g), PYTHON_LOOP + " D2D", gbps(page_bytes, vg), None),
        ("scatter kernel", gbps(nbytes, s), PYTHON_LOOP + " D2D", gbps(page_bytes, vs), None),
    ]
    cp.cuda.runtime.free(other)
    staging.free()
    return nbytes


def start_daemon(workdir: Path, args) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    log = open(workdir / "daemon.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "serve", "--socket", address, "--cpu-bytes",
         f"{args.arena_gib}GiB", "--nvme-bytes", "0", "--copy-threads", str(args.copy_threads),
         "--metrics-addr", "off", "--arena-name", f"kvtierd-bench-{os.getpid()}",
         "--nvme-dir", str(workdir / "nvme")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((workdir / "daemon.log").read_text())
        try:
            pinning = call(address, Op.STATS, timeout_s=1)["stats"]["cuda"]["pinning"]
            if pinning and pinning["state"] in ("ready", "failed", "unavailable"):
                print(f"daemon arena pinning: {pinning}", flush=True)
                return proc, address
        except DaemonUnavailable:
            pass
        time.sleep(0.5)
    raise RuntimeError("daemon did not become ready")


def _smi(query: str) -> list[list[str]]:
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.splitlines()]


def daemon_gpu_mib(pid: int) -> float:
    """The daemon's GPU memory as nvidia-smi lists it per process (NaN where a container's pid
    namespace hides it; see ``gpu_used_mib`` for the fallback)."""
    for fields in _smi("--query-compute-apps=pid,used_memory"):
        if len(fields) == 2 and fields[0] == str(pid):
            return float(fields[1])
    return float("nan")


def gpu_used_mib() -> float:
    """GPU 0's used memory: the daemon's share is the rise while only it allocates."""
    rows = _smi("--query-gpu=memory.used")
    return float(rows[0][0]) if rows and rows[0] else float("nan")


def end_to_end_rows(args, results, workdir: Path):
    layout, kv = layout_and_cache(args.layers, args.page, args.blocks, args.bpc)
    tables = build_page_tables(layout, kv)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50000, (16 * args.blocks,), generator=gen).tolist()
    chunks = layout.plan(tokens, [list(range(args.blocks))], trim_sliding_window=False)
    nbytes = sum(c.nbytes for c in chunks)
    snapshot = {name: t.clone() for name, t in kv.items()}
    torch.cuda.synchronize()
    used_before = gpu_used_mib()
    proc, address = start_daemon(workdir, args)
    try:
        before = daemon_gpu_mib(proc.pid)  # its CUDA context (pinning made it), no session yet
        how = "per process"
        if before != before:  # NaN: per-process use hidden; nothing else allocates meanwhile
            before, how = gpu_used_mib() - used_before, "rise of GPU 0's use"
        results.append(("daemon GPU memory", before, f"MiB before HELLO (nvidia-smi, {how})",
                        0, None))
        client = KVTierClient.connect(address, layout=layout, kv_caches=kv,
                                      staging_bytes=min(nbytes, args.staging_mib << 20))

        def store_timed():
            client.delete(chunks)
            start = time.perf_counter()
            stored = client.store(chunks).result(timeout=120)
            elapsed = (time.perf_counter() - start) * 1000
            assert all(stored), f"{stored.count(False)} of {len(stored)} chunks not stored"
            return elapsed

        def load_all():
            hits = client.load(chunks).result(timeout=120)
            assert all(hits), f"{hits.count(False)} of {len(hits)} chunks missed on load"

        store_timed()
        off = sorted(store_timed() for _ in range(5))[2]
        load = time_ms(load_all, 5)
        for t in kv.values():  # the bytes, not only the hits: poison, load, compare
            t.fill_(0xAB)
        load_hits = client.load(chunks).result(timeout=120)
        assert all(load_hits), "chunks missed on the verifying load"
        torch.cuda.synchronize()
        for name, t in kv.items():
            assert torch.equal(t, snapshot[name]), f"layer {name} differs after the round trip"
        after = daemon_gpu_mib(proc.pid)
        results.append(("daemon GPU memory", after, "MiB after traffic (nvidia-smi per "
                        "process; nan: hidden)", 0, None))
        stats = client.stats()
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.cuda.runtime.malloc(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)
    hptr = host.ptr
    d2h = event_ms(lambda: cp.cuda.runtime.memcpyAsync(hptr, dev, nbytes, 2, stream.ptr),
                   stream, 5)
    h2d = event_ms(lambda: cp.cuda.runtime.memcpyAsync(dev, hptr, nbytes, 1, stream.ptr),
                   stream, 5)
    pages = [(layer.pages[b].data_ptr(), args.page) for c in chunks for layer in tables[0]
             for b in c.block_ids][:args.python_pages]
    page_bytes = sum(n for _, n in pages)
    vd2h = event_ms(lambda: per_page_copy(pages, hptr, 2, False, stream), stream, 3, 1)
    vh2d = event_ms(lambda: per_page_copy(pages, hptr, 1, True, stream), stream, 3, 1)
    cp.cuda.runtime.free(dev)
    results += [
        ("offload via daemon", gbps(nbytes, off), "pinned D2H memcpy", gbps(nbytes, d2h), 0.85),
        ("load via daemon", gbps(nbytes, load), "pinned H2D memcpy", gbps(nbytes, h2d), 0.85),
        ("offload via daemon", gbps(nbytes, off), PYTHON_LOOP + " D2H", gbps(page_bytes, vd2h),
         None),
        ("load via daemon", gbps(nbytes, load), PYTHON_LOOP + " H2D", gbps(page_bytes, vh2d),
         None),
    ]
    return nbytes, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="layers (each K and V)")
    parser.add_argument("--page", type=int, default=32768, help="page bytes (16 tok x 8 x 128 bf16)")
    parser.add_argument("--blocks", type=int, default=2048,
                        help="blocks per layer (2048: 2 GiB batches, small launch overhead)")
    parser.add_argument("--bpc", type=int, default=16, help="blocks per chunk")
    parser.add_argument("--arena-gib", type=int, default=4)
    parser.add_argument("--copy-threads", type=int, default=8)
    parser.add_argument("--staging-mib", type=int, default=1024)
    parser.add_argument("--python-pages", type=int, default=4096,
                        help="pages the per-page Python loop rows copy (bounded: ~10 us each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: list[tuple] = []
    kernel_bytes = kernel_rows(args, results)
    with tempfile.TemporaryDirectory() as tmp:
        e2e_bytes, stats = end_to_end_rows(args, results, Path(tmp))
    rows = []
    print(f"\nGPU transfer ({torch.cuda.get_device_name(0)}; kernel batch "
          f"{kernel_bytes / GiB:.2f} GiB, end-to-end {e2e_bytes / GiB:.2f} GiB, page {args.page} B)")
    print(f"{'ours':<20} {'GB/s':>8}  {'vs':<30} {'GB/s':>8} {'ratio':>6} {'target':>7}")
    for ours, a, peer, b, target in results:
        if not b:  # a measurement without a peer
            print(f"{ours:<20} {a:8.1f}  {peer}")
            rows.append({"ours": ours, "value": a, "unit": peer})
            continue
        ratio = a / b if b else float("nan")
        verdict = "" if target is None else (f">={target}" + (" ok" if ratio >= target else " MISS"))
        print(f"{ours:<20} {a:8.1f}  {peer:<30} {b:8.1f} {ratio:6.2f} {verdict:>7}")
        rows.append({"ours": ours, "ours_gbps": a, "peer": peer, "peer_gbps": b,
                     "ratio": ratio, "target": target})
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "daemon_stats": stats}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
