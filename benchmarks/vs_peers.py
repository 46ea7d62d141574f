"""kvtierd against peer KV stores and a memcpy ceiling, all measured in one run.

    .venv/bin/python benchmarks/vs_peers.py [--peers lmcache,mooncake|all|none] [--quick]
                                            [--rounds N] [--repeat N] [--json out.json]

Each peer is a module in ``benchmarks/peers/`` (the contract is in ``peers/__init__.py``); it
installs itself into its own environment under ``.cache/peers/`` on first use and returns rows of
``path`` "kv tensors" (paged KV blocks through the engine-side client: LMCache's multiprocess
server) or "raw bytes" (contiguous buffers: Mooncake Store). For every path a peer uses, kvtierd
runs the same workload through a real daemon:

* kv tensors: ``KVTierClient`` stores a batch of chunks gathered from random blocks of a
  Llama-like cache (32 layers, one 16-token block per chunk, 8 KiB pages for 256 KiB chunks,
  64 KiB pages for 2 MiB chunks; ``peers.KVGeometry``) and loads them into other, poisoned
  blocks: a load is LOOKUP (leasing the hits, as the vLLM scheduler does) + GET + scatter, since
  LMCache's load is lookup + prefetch + retrieve. Every load is compared byte for byte.
* raw bytes: one PUT / one GET batch of ``chunk_bytes`` items from a filled memfd staging buffer
  (``raw_session.Session``, no KV copies).

The ceiling is one single-threaded memcpy of the same batch into pre-faulted memory, in this
process. Every figure is the best of ``--rounds``; ``--repeat`` runs everything again (ceiling,
kvtierd, peers, interleaved) and reports each repeat, since on a shared machine the ratios of one
repeat are what is comparable. Target (issue 12): kvtierd >= 1.5x LMCache on store and load at
256 KiB and 2 MiB. ``--quick`` (tiny batches, one round, 256 KiB only) is for the smoke test; its
figures mean nothing. Nothing asserts on speed: the table is printed and written as JSON
(default ``benchmarks/results/vs_peers.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import torch
import zmq

from kvtier_client import KVGroup, KVLayout, KVTierClient
from kvtier_client.planner import Chunk
from kvtierd.protocol import PROTOCOL_VERSION, Op
from peers import (PATH_KV, PATH_RAW, QUICK_BATCH_BYTES, BATCH_BYTES, KVGeometry, PeerUnavailable,
                   checked_rows, discover, loaded_correctly, poison)
from raw_session import Session

SIZES = [256 * 1024, 2 * 1024**2]
RESULTS = Path(__file__).resolve().parent / "results"


def start_daemon(workdir: Path, cpu_bytes: str) -> tuple[subprocess.Popen, str]:
    """A real ``kvtierd serve`` on an ipc socket in ``workdir`` (no NVMe tier, no exporter);
    returns once it answers PING."""
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "serve", "--socket", address, "--cpu-bytes", cpu_bytes,
         "--nvme-bytes", "0", "--metrics-addr", "off", "--log-level", "WARNING"],
        cwd=workdir, env={**os.environ, "XDG_STATE_HOME": str(workdir)})
    probe = zmq.Context.instance().socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(address)
    deadline = time.monotonic() + 60
    try:
        probe.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 1}))
        while not probe.poll(200):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"kvtierd did not start (exit {proc.poll()})")
    finally:
        probe.close(linger=0)
    return proc, address


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def best(fn, rounds: int) -> float:
    """Seconds of the fastest of ``rounds`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy_gbps(nbytes: int, rounds: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # pre-faulted, as the daemon's arena is
    return nbytes / 1e9 / best(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
                               rounds)


def kv_layout(geo: KVGeometry, rank: int = 0, world_size: int = 1) -> KVLayout:
    group = KVGroup(tokens_per_block=16, page_bytes=geo.page_bytes, layer_names=geo.layer_names)
    return KVLayout(groups=[group], blocks_per_chunk=1, tokens_per_hash=16, dtype="bfloat16",
                    model=f"kvtierd-bench-{geo.chunk_bytes}", kv_layout="NHD",
                    rank=rank, world_size=world_size)


class KVRound:
    """One store + load round through ``KVTierClient`` over ``geo``, new keys every round."""

    def __init__(self, client: KVTierClient, geo: KVGeometry, kv: dict, tag: bytes) -> None:
        self.client, self.geo, self.kv, self.tag = client, geo, kv, tag
        self.src, self.dst = geo.block_ids()
        self.n = 0
        self.stored: list[Chunk] = []

    def _chunks(self, blocks: list[int], n: int) -> list[Chunk]:
        return [Chunk(key=self.tag + n.to_bytes(4, "big") + i.to_bytes(4, "big"), group=0,
                      block_ids=(b,), token_start=16 * i, token_end=16 * (i + 1),
                      nbytes=self.geo.chunk_bytes) for i, b in enumerate(blocks)]

    def store(self) -> None:
        self.n += 1
        batch = self._chunks(self.src, self.n)
        if not all(self.client.store(batch).result(timeout=120)):
            raise RuntimeError(f"kvtierd: a store of {len(batch)} chunks failed")
        self.stored = batch

    def load(self) -> None:
        into = self._chunks(self.dst, self.n)
        if not all(self.client.lookup(into, lease=True)):
            raise RuntimeError("kvtierd: a LOOKUP missed chunks it had just stored")
        if not all(self.client.load(into).result(timeout=120)):
            raise RuntimeError("kvtierd: a load missed chunks it had just stored")


def kvtierd_kv_row(address: str, size: int, rounds: int, batch_bytes: int) -> dict:
    geo = KVGeometry(size, batch_bytes)
    kv = geo.kv_caches()
    staging = geo.chunks * size + 4096  # one batch is one PUT / one GET, as for the peer
    client = KVTierClient.connect(address, layout=kv_layout(geo), kv_caches=kv,
                                  staging_bytes=staging)
    try:
        r = KVRound(client, geo, kv, os.urandom(8))
        store_s = best(r.store, rounds)
        load_times = []
        for _ in range(rounds):  # each load is timed alone: poisoning and checking are not
            poison(kv, r.dst)
            start = time.perf_counter()
            r.load()
            load_times.append(time.perf_counter() - start)
            if not loaded_correctly(kv, r.src, r.dst):
                raise RuntimeError("kvtierd: the loaded blocks differ from the stored ones")
    finally:
        client.close()
    gb = geo.chunks * size / 1e9
    return {"peer": "kvtierd", "path": PATH_KV, "chunk_bytes": size, "store_gbps": gb / store_s,
            "load_gbps": gb / min(load_times), "batch_bytes": geo.chunks * size}


def kvtierd_raw_row(address: str, size: int, rounds: int, batch_bytes: int) -> dict:
    count = max(1, batch_bytes // size)
    session = Session(address, count * size)
    try:
        put_s, get_s = [], []
        for r in range(rounds + 1):  # round 0 warms up
            items = [[f"raw-{size}-{r}-{i}".encode(), i * size, size] for i in range(count)]
            t0 = time.perf_counter()
            put = session.call(Op.PUT, items=items)
            t1 = time.perf_counter()
            get = session.call(Op.GET, items=items)
            t2 = time.perf_counter()
            if any(put["results"]) or any(get["results"]):
                raise RuntimeError(f"kvtierd raw: PUT/GET failed: {put.get('errors')}")
            session.call(Op.DELETE, keys=[k for k, _, _ in items])
            if r:
                put_s.append(t1 - t0)
                get_s.append(t2 - t1)
    finally:
        session.close()
    gb = count * size / 1e9
    return {"peer": "kvtierd", "path": PATH_RAW, "chunk_bytes": size,
            "store_gbps": gb / min(put_s), "load_gbps": gb / min(get_s),
            "batch_bytes": count * size}


def measure(peers: dict, sizes: list[int], rounds: int, batch_bytes: int, workdir: Path) -> dict:
    """One repeat: the ceiling, kvtierd on both paths, then each peer."""
    ceiling = {size: memcpy_gbps(max(1, batch_bytes // size) * size, rounds) for size in sizes}
    rows: list[dict] = []
    proc, address = start_daemon(workdir, f"{max(256, 8 * batch_bytes // 1024**2)}MiB")
    try:
        for size in sizes:
            rows.append(kvtierd_kv_row(address, size, rounds, batch_bytes))
            rows.append(kvtierd_raw_row(address, size, rounds, batch_bytes))
    finally:
        stop_daemon(proc)
    skipped = {}
    for name, module in peers.items():
        peer_dir = workdir / name
        peer_dir.mkdir(exist_ok=True)
        try:
            extra = ({"batch_bytes": batch_bytes}
                     if "batch_bytes" in inspect.signature(module.run).parameters else {})
            rows += checked_rows(name, module.run(sizes, rounds, peer_dir, **extra))
        except PeerUnavailable as exc:
            skipped[name] = str(exc)
            print(f"{name}: not measured: {exc}", file=sys.stderr)
    for row in rows:
        row["memcpy_gbps"] = ceiling[row["chunk_bytes"]]
    return {"ceiling_memcpy_gbps": {str(k): v for k, v in ceiling.items()}, "rows": rows,
            "ratios": ratios(rows), "skipped": skipped}


def ratios(rows: list[dict]) -> list[dict]:
    """kvtierd / peer, store and load, for every peer row that has a kvtierd row of its path."""
    ours = {(r["path"], r["chunk_bytes"]): r for r in rows if r["peer"] == "kvtierd"}
    out = []
    for row in rows:
        mine = ours.get((row["path"], row["chunk_bytes"]))
        if row["peer"] == "kvtierd" or mine is None:
            continue
        out.append({"peer": row["peer"], "path": row["path"], "chunk_bytes": row["chunk_bytes"],
                    "store_x": mine["store_gbps"] / row["store_gbps"],
                    "load_x": mine["load_gbps"] / row["load_gbps"]})
    return out


def size_name(n: int) -> str:
    return f"{n // 1024**2}MiB" if n % 1024**2 == 0 else f"{n // 1024}KiB"


def print_repeat(index: int, result: dict) -> None:
    print(f"\nrepeat {index}: GB/s, best of rounds; memcpy = the ceiling in this repeat")
    print(f"{'peer':<10}{'path':<12}{'chunk':>7}{'store':>8}{'load':>8}{'memcpy':>8}"
          f"{'store/cp':>10}{'load/cp':>9}")
    for r in result["rows"]:
        cp = r["memcpy_gbps"]
        print(f"{r['peer']:<10}{r['path']:<12}{size_name(r['chunk_bytes']):>7}"
              f"{r['store_gbps']:>8.3f}{r['load_gbps']:>8.3f}{cp:>8.2f}"
              f"{r['store_gbps'] / cp:>9.3f}x{r['load_gbps'] / cp:>8.3f}x")
    for x in result["ratios"]:
        print(f"kvtierd vs {x['peer']} ({x['path']}, {size_name(x['chunk_bytes'])}): "
              f"store {x['store_x']:.2f}x, load {x['load_x']:.2f}x")


def select_peers(spec: str) -> dict:
    found = discover()
    if spec == "none":
        return {}
    if spec == "all":
        return found
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in found]
    if unknown:
        raise SystemExit(f"--peers {spec!r}: unknown {unknown}; allowed: none, all or a "
                         f"comma-separated list of {sorted(found)}")
    return {n: found[n] for n in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="lmcache",
                        help="none, all, or a comma-separated list of peers/ modules")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--quick", action="store_true",
                        help="tiny batches, one round, 256 KiB only (a smoke test)")
    parser.add_argument("--json", type=Path, default=RESULTS / "vs_peers.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeat < 1:
        parser.error(f"--rounds={args.rounds} --repeat={args.repeat}; allowed: >= 1")
    peers = select_peers(args.peers)
    sizes = SIZES[:1] if args.quick else SIZES
    rounds = 1 if args.quick else args.rounds
    batch = QUICK_BATCH_BYTES if args.quick else BATCH_BYTES
    repeats = []
    with tempfile.TemporaryDirectory(prefix="kvtierd-vs-peers-") as tmp:
        for i in range(args.repeat):
            work = Path(tmp, str(i))
            work.mkdir()
            repeats.append(measure(peers, sizes, rounds, batch, work))
            print_repeat(i, repeats[-1])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"sizes": sizes, "rounds": rounds, "batch_bytes": batch,
                                     "peers": sorted(peers), "repeats": repeats}, indent=2))
    print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
