"""KVTierClient store/load on the CPU path against the copies it cannot avoid, in the same run.

    .venv/bin/python benchmarks/client_path.py [--rounds N] [--json out.json]

A Llama-like layout (32 layers, one group, random block ids: a real block table is a permutation)
is stored and loaded through a real daemon by ``KVTierClient``. The ceiling is the same bytes moved
by the two copies the path is made of, each run alone in this process: the page-sized gather from
the KV cache into staging (one memmove per page) plus the daemon's staging → arena copy (one
contiguous memmove of the batch). Also shown: the torch reference gather/scatter (``copies``, what
the client ran before ``host_copies``) over the same batch. Target (issue 12): store and load
>= 0.8x the ceiling. Nothing asserts; the table is printed and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtier_client import KVGroup, KVLayout, KVTierClient
from kvtier_client.copies import CopyUnit, build_page_tables, gather, scatter
from kvtier_client.planner import Chunk

LAYERS = 32
CASES = {  # name: (page bytes, blocks per chunk) -> chunk = LAYERS * bpc * page
    "256KiB": (8 * 1024, 1),
    "2MiB": (64 * 1024, 1),
    "8MiB": (64 * 1024, 4),
}
BATCH_BYTES = 32 * 1024**2
BLOCKS = 512


def start_daemon(workdir: Path) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "serve", "--socket", address, "--cpu-bytes", "1GiB",
         "--nvme-bytes", "0", "--metrics-addr", "off", "--log-level", "WARNING"])
    deadline = time.monotonic() + 60
    sock = Path(address[len("ipc://"):])
    while not (sock.exists() and Path(f"{sock}.hs").exists()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("kvtierd did not start")
        time.sleep(0.05)
    return proc, address


def best(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_case(address: str, page: int, bpc: int, rounds: int) -> dict[str, float]:
    names = tuple(f"model.layers.{i}" for i in range(LAYERS))
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=page, layer_names=names)],
                      blocks_per_chunk=bpc, tokens_per_hash=16, model=f"bench-{page}-{bpc}",
                      dtype="bfloat16")
    kv = {n: torch.randint(0, 256, (BLOCKS, page), dtype=torch.uint8) for n in names}
    chunk_bytes = layout.chunk_nbytes(0)
    count = max(1, BATCH_BYTES // chunk_bytes)
    perm = np.random.default_rng(0).permutation(BLOCKS)
    total = count * chunk_bytes
    client = KVTierClient.connect(address, layout=layout, kv_caches=kv,
                                  staging_bytes=total + 4096)
    try:
        n = [0]

        def chunks() -> list[Chunk]:  # new keys every round: each store really copies
            n[0] += 1
            return [Chunk(key=n[0].to_bytes(4, "big") + i.to_bytes(4, "big") * 2, group=0,
                          block_ids=tuple(int(b) for b in perm[i * bpc:(i + 1) * bpc]),
                          token_start=0, token_end=16 * bpc, nbytes=chunk_bytes)
                    for i in range(count)]

        stored: list[Chunk] = []

        def store() -> None:
            batch = chunks()
            assert all(client.store(batch).result(timeout=60)), "store failed"
            stored[:] = batch

        store_s = best(store, rounds)

        def load() -> None:
            assert all(client.load(stored).result(timeout=60)), "load missed"

        load_s = best(load, rounds)
    finally:
        client.close()

    tables = build_page_tables(layout, kv)
    units = [CopyUnit(0, tuple(int(b) for b in perm[i * bpc:(i + 1) * bpc]), i * chunk_bytes)
             for i in range(count)]
    staging = torch.empty(total, dtype=torch.uint8)
    arena = torch.empty(total, dtype=torch.uint8)
    arena.fill_(1)
    srcs = [tables[0][layer].pages[b].data_ptr() for u in units for layer in range(LAYERS)
            for b in u.block_ids]

    def page_gather() -> None:
        dst = staging.data_ptr()
        for src in srcs:
            ctypes.memmove(dst, src, page)
            dst += page

    gather_s = best(page_gather, rounds)
    copy_s = best(lambda: ctypes.memmove(arena.data_ptr(), staging.data_ptr(), total), rounds)
    ref_gather_s = best(lambda: gather(tables, units, staging), rounds)
    ref_scatter_s = best(lambda: scatter(tables, units, staging), rounds)
    ceiling_s = gather_s + copy_s
    gb = total / 1e9
    return {
        "chunk_bytes": chunk_bytes, "batch_bytes": total,
        "store_gbs": gb / store_s, "load_gbs": gb / load_s, "ceiling_gbs": gb / ceiling_s,
        "store_ratio": ceiling_s / store_s, "load_ratio": ceiling_s / load_s,
        "torch_gather_gbs": gb / ref_gather_s, "torch_scatter_gbs": gb / ref_scatter_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-") as tmp:
        proc, address = start_daemon(Path(tmp))
        try:
            results = {name: bench_case(address, page, bpc, args.rounds)
                       for name, (page, bpc) in CASES.items()}
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{'chunk':<8}{'store GB/s':>11}{'load GB/s':>11}{'ceiling':>9}{'store/ceil':>11}"
          f"{'load/ceil':>10}{'torch gather':>13}{'torch scatter':>14}")
    for name, r in results.items():
        print(f"{name:<8}{r['store_gbs']:>11.2f}{r['load_gbs']:>11.2f}{r['ceiling_gbs']:>9.2f}"
              f"{r['store_ratio']:>10.2f}x{r['load_ratio']:>9.2f}x{r['torch_gather_gbs']:>13.2f}"
              f"{r['torch_scatter_gbs']:>14.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
