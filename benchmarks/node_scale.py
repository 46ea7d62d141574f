"""A TP=8 node on one daemon: 8 worker processes storing and loading at once, and the scheduler's
LOOKUP latency meanwhile, against the same 8 processes doing the copies alone.

    .venv/bin/python benchmarks/node_scale.py [--ranks 8] [--rounds N] [--chunk-bytes B]
                                              [--batch-bytes B] [--quick] [--json out.json]

Ranks 0..7 are separate processes of one tenant (the same uid), each a ``KVTierClient`` with its
own layout (``rank=r, world_size=8``: every rank holds different bytes under its own keys) over
its own KV cache: by default one KV head per rank, as Llama-3-8B's 8 KV heads split over TP=8,
so 8 KiB pages and 256 KiB chunks of 32 layers (``peers.KVGeometry``). Phases, the ranks in
lock step (a barrier between phases):

1. store: ``--rounds`` batches per rank, each one ``store`` of ``--batch-bytes`` from random
   blocks;
2. load: each stored batch back, LOOKUP (leasing) + ``load`` into other blocks, poisoned before
   the phase and compared byte for byte with the stored blocks after it;
3. ceiling: the same bytes through the copies a store cannot avoid, in the same processes: the
   page-sized gather (one memmove per page) plus one contiguous copy of the batch (the daemon's
   staging -> arena copy), ``--rounds`` times.

Aggregate GB/s of a phase = all ranks' bytes / (last rank's end - first rank's start). Meanwhile a
scheduler process (``KVTierIndex``, as the vLLM scheduler side runs) sends one LOOKUP of 64 keys
(a 1024-token prefix of rank 0) every 2 ms; its latencies before the ranks start (idle) and
during the store and load phases (under load) give p50/p99. On a 2-core machine the absolute
numbers are small: the ratio against the ceiling of the same run is the figure. ``--quick`` (two
rounds of tiny batches) is for the smoke test. Nothing asserts on speed; the table is printed and
written as JSON (default ``benchmarks/results/node_scale.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LOOKUP_KEYS = 64
LOOKUP_PERIOD_S = 0.002
TIMEOUT_S = 120


def chunk_key(rank: int, batch: int, i: int) -> bytes:
    return b"node" + bytes([rank]) + batch.to_bytes(4, "big") + i.to_bytes(4, "big")


def _chunks(geo, rank: int, batch: int, blocks: list[int]):
    from kvtier_client.planner import Chunk

    return [Chunk(key=chunk_key(rank, batch, i), group=0, block_ids=(b,), token_start=16 * i,
                  token_end=16 * (i + 1), nbytes=geo.chunk_bytes) for i, b in enumerate(blocks)]


def page_pointers(kv: dict, src: list[int]) -> list[int]:
    """Addresses of the batch's pages in staging order (chunk by chunk, layer by layer), taken
    once so that the ceiling times the copies, not tensor indexing."""
    return [t[b].data_ptr() for b in src for t in kv.values()]


def _ceiling_round(pages: list[int], staging, arena, page: int) -> None:
    """The copies of one store: every page of the batch into staging, then staging -> arena."""
    dst = staging.data_ptr()
    for src in pages:
        ctypes.memmove(dst, src, page)
        dst += page
    ctypes.memmove(arena.data_ptr(), staging.data_ptr(), staging.numel())


def rank_main(rank: int, ranks: int, address: str, geo_args: tuple, rounds: int, barrier,
              results) -> None:
    """One TP worker: the three phases, timed; its spans and check go to ``results``."""
    import torch

    from peers import KVGeometry, loaded_correctly, poison
    from kvtier_client import KVTierClient
    from vs_peers import kv_layout

    geo = KVGeometry(*geo_args, seed=rank)
    kv = geo.kv_caches()
    src, dst = geo.block_ids()
    total = geo.chunks * geo.chunk_bytes
    out: dict = {"rank": rank, "bytes_per_phase": total * rounds}
    client = KVTierClient.connect(address, layout=kv_layout(geo, rank, ranks), kv_caches=kv,
                                  staging_bytes=total + 4096)
    try:
        client.store(_chunks(geo, rank, 0, src)).result(timeout=TIMEOUT_S)  # warm-up
        poison(kv, dst)
        barrier.wait(timeout=TIMEOUT_S)
        t0 = time.perf_counter()
        stored = [all(client.store(_chunks(geo, rank, n, src)).result(timeout=TIMEOUT_S))
                  for n in range(1, rounds + 1)]
        out["store"] = (t0, time.perf_counter())
        barrier.wait(timeout=TIMEOUT_S)
        t0 = time.perf_counter()
        loaded = []
        for n in range(1, rounds + 1):
            into = _chunks(geo, rank, n, dst)
            hits = client.lookup(into, lease=True)
            loaded.append(all(hits) and all(client.load(into).result(timeout=TIMEOUT_S)))
        out["load"] = (t0, time.perf_counter())
        out["ok"] = all(stored) and all(loaded) and loaded_correctly(kv, src, dst)
    finally:
        client.close()
    staging = torch.empty(total, dtype=torch.uint8).fill_(1)  # pre-faulted, as staging is
    arena = torch.empty(total, dtype=torch.uint8).fill_(1)
    pages = page_pointers(kv, src)
    _ceiling_round(pages, staging, arena, geo.page_bytes)  # warm-up
    barrier.wait(timeout=TIMEOUT_S)
    t0 = time.perf_counter()
    for _ in range(rounds):
        _ceiling_round(pages, staging, arena, geo.page_bytes)
    out["ceiling"] = (t0, time.perf_counter())
    results.put(out)


def scheduler_main(address: str, ranks: int, geo_args: tuple, start, done, results) -> None:
    """The scheduler: LOOKUPs of rank 0's keys every ``LOOKUP_PERIOD_S``, each one timed."""
    from peers import KVGeometry
    from kvtier_client.index import KVTierIndex
    from vs_peers import kv_layout

    layout = kv_layout(KVGeometry(*geo_args, seed=0), 0, ranks)
    index = KVTierIndex(address, namespace=layout.namespace, rank=0, world_size=ranks,
                        fingerprint=layout.fingerprint, timeout_s=10.0)
    keys = [chunk_key(0, 1, i % 4096) for i in range(LOOKUP_KEYS)]
    samples: list[tuple[float, float]] = []
    try:
        index.lookup(keys)  # the session opens here, untimed
        start.set()
        while not done.is_set():
            t0 = time.perf_counter()
            index.lookup(keys)
            samples.append((t0, time.perf_counter() - t0))
            time.sleep(LOOKUP_PERIOD_S)
    finally:
        failures = index.failures
        index.close()
    results.put({"scheduler": samples, "failures": failures})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def aggregate(per_rank: list[dict], phase: str) -> float:
    """GB/s of all ranks together over the phase's wall span."""
    start = min(r[phase][0] for r in per_rank)
    end = max(r[phase][1] for r in per_rank)
    return sum(r["bytes_per_phase"] for r in per_rank) / 1e9 / (end - start)


def _result(results, workers: list) -> dict:
    """The next result, or an error as soon as a worker died without sending one."""
    import queue

    deadline = time.monotonic() + 10 * TIMEOUT_S
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"a rank process failed (exit codes {dead})") from None


def run(ranks: int, rounds: int, chunk_bytes: int, batch_bytes: int, workdir: Path) -> dict:
    from vs_peers import start_daemon, stop_daemon

    geo_args = (chunk_bytes, batch_bytes)
    cpu_mib = max(256, 2 * ranks * (rounds + 1) * batch_bytes // 1024**2)
    proc, address = start_daemon(workdir, f"{cpu_mib}MiB")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    start, done = ctx.Event(), ctx.Event()
    workers = []
    try:
        sched = ctx.Process(target=scheduler_main,
                            args=(address, ranks, geo_args, start, done, results))
        sched.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not start.wait(timeout=0.2):
            if not sched.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler process did not open its session "
                                   f"(exit code {sched.exitcode})")
        time.sleep(1.0)  # idle samples: the daemon serves only the scheduler
        idle_until = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        workers = [ctx.Process(target=rank_main, args=(r, ranks, address, geo_args, rounds,
                                                       barrier, results))
                   for r in range(ranks)]
        for w in workers:
            w.start()
        got = [_result(results, workers) for _ in range(ranks)]
        done.set()
        got.append(results.get(timeout=TIMEOUT_S))
    finally:
        done.set()
        for w in [*workers, sched]:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
        stop_daemon(proc)
    per_rank = sorted((g for g in got if "rank" in g), key=lambda g: g["rank"])
    sched_out = next(g for g in got if "scheduler" in g)
    busy_from = min(r["store"][0] for r in per_rank)
    busy_to = max(r["load"][1] for r in per_rank)
    idle = [lat for t, lat in sched_out["scheduler"] if t + lat < idle_until]
    busy = [lat for t, lat in sched_out["scheduler"] if busy_from <= t <= busy_to]
    store, load, ceiling = (aggregate(per_rank, p) for p in ("store", "load", "ceiling"))
    return {
        "ranks": ranks, "rounds": rounds, "chunk_bytes": chunk_bytes,
        "batch_bytes": per_rank[0]["bytes_per_phase"] // rounds,
        "all_loads_correct": all(r["ok"] for r in per_rank),
        "store_gbps": store, "load_gbps": load, "ceiling_gbps": ceiling,
        "store_ratio": store / ceiling, "load_ratio": load / ceiling,
        "lookup_keys": LOOKUP_KEYS, "lookup_failures": sched_out["failures"],
        "lookup_idle": {"n": len(idle), "p50_ms": 1e3 * percentile(idle, 0.5),
                        "p99_ms": 1e3 * percentile(idle, 0.99)},
        "lookup_under_load": {"n": len(busy), "p50_ms": 1e3 * percentile(busy, 0.5),
                              "p99_ms": 1e3 * percentile(busy, 0.99)},
    }


def print_table(r: dict) -> None:
    print(f"{r['ranks']} ranks, {r['chunk_bytes'] // 1024} KiB chunks, "
          f"{r['batch_bytes'] / 1024**2:.0f} MiB per request, {r['rounds']} rounds; "
          f"loads byte-exact: {r['all_loads_correct']}")
    print(f"{'phase':<10}{'GB/s':>8}{'/ceiling':>10}")
    print(f"{'store':<10}{r['store_gbps']:>8.3f}{r['store_ratio']:>9.3f}x")
    print(f"{'load':<10}{r['load_gbps']:>8.3f}{r['load_ratio']:>9.3f}x")
    print(f"{'ceiling':<10}{r['ceiling_gbps']:>8.3f}")
    for name in ("lookup_idle", "lookup_under_load"):
        s = r[name]
        print(f"LOOKUP of {r['lookup_keys']} keys, {name[7:]}: p50 {s['p50_ms']:.2f} ms, "
              f"p99 {s['p99_ms']:.2f} ms ({s['n']} samples)")
    if r["lookup_failures"]:
        print(f"LOOKUP failures (answered as misses): {r['lookup_failures']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    parser.add_argument("--batch-bytes", type=int, default=8 * 1024**2)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 MiB (a smoke test)")
    parser.add_argument("--json", type=Path, default=RESULTS / "node_scale.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch_bytes = 2, 1024**2
    if not 1 <= args.ranks <= 255 or args.rounds < 1:
        parser.error(f"--ranks={args.ranks} --rounds={args.rounds}; allowed: ranks in 1..255, "
                     "rounds >= 1")
    with tempfile.TemporaryDirectory(prefix="kvtierd-node-") as tmp:
        result = run(args.ranks, args.rounds, args.chunk_bytes, args.batch_bytes, Path(tmp))
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"written: {args.json}")
    return 0 if result["all_loads_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
