"""CPU-path throughput and latency of kvtierd against ceilings and a peer measured in the same run.

    .venv/bin/python benchmarks/cpu_roundtrip.py [--json out.json] [--rounds N] [--quick]

* PUT / GET GB/s through a real daemon for 16 KiB, 64 KiB, 256 KiB, 2 MiB and 16 MiB chunks
  (staging already filled; one batched request per 64 MiB, at most ``max_batch`` items), against
  (a) a plain single-threaded memcpy of the same bytes into pre-faulted memory (the ceiling), and
      beside it the same loop calling the daemon's own streaming-store copy instead of memmove
      (``stream``: glibc's memmove stores through the cache here, so a PUT, which streams, can
      pass the memcpy ceiling; this column says by how much the copy alone would), and
  (b) a real ``redis-server`` on a unix socket doing pipelined SET/GET of the same sizes (the peer:
      LMCache uses Redis as a backend). Needs the ``redis-server`` binary and the ``redis`` package
      (``pip install -e '.[bench]'``); without them that column is skipped, with a note.
* PING p50/p99 against a raw pyzmq DEALER/ROUTER echo in another process over ipc (the ceiling).
* Batched LOOKUP keys/s (4096 keys per request, half of them hits).

Targets (see the README): >= 0.8x memcpy and >= 5x Redis for 2 MiB, >= 0.5x memcpy for 16 KiB and
>= 0.8x for 64 KiB (per-item cost in the daemon), PING p50 <= 1.5x raw ZeroMQ, >= 200k keys/s
batched lookup. Numbers are printed as a table and written as JSON; nothing asserts. Each size
runs ``--rounds`` rounds, each a memcpy pass, a streaming-copy pass, then the daemon's PUT and GET
of the same batch: ``PUT/mc`` is the daemon's mean over the rounds against the best memcpy pass,
``PUT/mc med`` the median of each round's own ratio (a neighbour's burst in one round moves the
mean, rarely the median).

``--quick`` runs every row on tiny sizes (a few items, one round, no Redis) so that a test can
check the output's shape; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import zmq

from kvtierd.protocol import PROTOCOL_VERSION, Op
from raw_session import Session

SIZES = {"16KiB": 16 * 1024, "64KiB": 64 * 1024, "256KiB": 256 * 1024, "2MiB": 2 * 1024**2,
         "16MiB": 16 * 1024**2}
BATCH_BYTES = 64 * 1024**2
MAX_ITEMS = 4096  # items per PUT/GET request (the daemon's max_batch default is 8192)
QUICK_SIZES = {"16KiB": 16 * 1024, "64KiB": 64 * 1024, "256KiB": 256 * 1024}
QUICK_BATCH_BYTES = 1024**2


def start_daemon(workdir: Path, cpu_bytes: str, nvme_bytes: str = "0"
                 ) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    # No NVMe tier by default: this is the CPU path, and a default tier would preallocate 4 GiB
    # under the state directory (named after this run's socket, so never reused) on every run.
    # With one (--nvme-bytes), PUT commits go through entries (the chain publishes them), as in a
    # default deployment; its files live in this run's workdir.
    nvme = ["--nvme-bytes", nvme_bytes] + (
        ["--nvme-dir", str(workdir / "nvme")] if nvme_bytes != "0" else [])
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "serve", "--socket", address, "--cpu-bytes", cpu_bytes,
         *nvme, "--metrics-addr", "off", "--log-level", "WARNING"])
    deadline = time.monotonic() + 60
    probe = zmq.Context.instance().socket(zmq.DEALER)
    probe.connect(address)
    probe.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 1}))
    while not probe.poll(200):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("kvtierd did not start")
    probe.close(linger=0)
    return proc, address


def item_count(size: int, batch_bytes: int) -> int:
    """Chunks per request (and per memcpy pass): one batch of ``batch_bytes``, capped."""
    return max(1, min(MAX_ITEMS, batch_bytes // size))


def daemon_round(session: Session, size: int, r: int, batch_bytes: int) -> tuple[float, float]:
    """One PUT and one GET of a batch of ``size`` chunks (then its DELETE): their seconds."""
    count = item_count(size, batch_bytes)
    keys = [f"{size}-{r}-{i}".encode() for i in range(count)]
    items = [[k, i * size, size] for i, k in enumerate(keys)]
    t0 = time.perf_counter()
    reply = session.call(Op.PUT, items=items)
    t1 = time.perf_counter()
    assert all(s == 0 for s in reply["results"]), reply["errors"][:3]
    reply = session.call(Op.GET, items=items)
    t2 = time.perf_counter()
    assert all(s == 0 for s in reply["results"]), reply["errors"][:3]
    session.call(Op.DELETE, keys=keys)
    return t1 - t0, t2 - t1


def streaming_copy():
    """The daemon's streaming-store copy (``kvtierd.copy._ranges``) as a ctypes function with
    memmove's arguments, or None where the extension was not built."""
    try:
        from kvtierd.copy import _ranges
    except ImportError:
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
        _ranges.streaming_copy_address())


class CopyCeiling:
    """The ceiling: one ``memmove`` (or another copy with its arguments) per chunk, of the same
    size and count as the daemon's batch, from random bytes into pre-faulted memory."""

    def __init__(self, size: int, batch_bytes: int) -> None:
        self.size, self.count = size, item_count(size, batch_bytes)
        nbytes = self.count * size
        self._src = mmap.mmap(-1, nbytes)
        self._dst = mmap.mmap(-1, nbytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        self._src.write(os.urandom(nbytes))
        self._s = ctypes.addressof(ctypes.c_char.from_buffer(self._src))
        self._d = ctypes.addressof(ctypes.c_char.from_buffer(self._dst))

    def once(self, copy=ctypes.memmove) -> float:
        """GB/s of one pass over the batch."""
        s, d, size = self._s, self._d, self.size
        t0 = time.perf_counter()
        for i in range(self.count):
            copy(d + i * size, s + i * size, size)
        return self.count * size / (time.perf_counter() - t0) / 1e9


def bench_size(session: Session, size: int, rounds: int, batch_bytes: int, stream) -> dict:
    """One size's row, interleaved round by round: a memcpy pass (and a streaming-copy pass),
    then the daemon's PUT and GET of the same batch. The row keeps the best memcpy and streaming
    passes against the daemon's mean over all rounds (as before), and, steadier on a shared
    machine, the median of each round's own PUT / memcpy and GET / memcpy."""
    ceiling = CopyCeiling(size, batch_bytes)
    total = ceiling.count * size
    memcpy, streamed, put_s, get_s = [], [], [], []
    for r in range(rounds):
        memcpy.append(ceiling.once())
        if stream is not None:
            streamed.append(ceiling.once(stream))
        put, get = daemon_round(session, size, r, batch_bytes)
        put_s.append(put)
        get_s.append(get)
    row = {"memcpy_gbs": max(memcpy), "items_per_request": ceiling.count,
           "put_gbs": total * rounds / sum(put_s) / 1e9,
           "get_gbs": total * rounds / sum(get_s) / 1e9,
           "put_ratio_median": statistics.median(total / t / 1e9 / m for t, m in zip(put_s, memcpy)),
           "get_ratio_median": statistics.median(total / t / 1e9 / m for t, m in zip(get_s, memcpy)),
           "rounds": {"memcpy_gbs": memcpy, "put_s": put_s, "get_s": get_s}}
    if streamed:
        row["stream_gbs"] = max(streamed)
    row["put_ratio"] = row["put_gbs"] / row["memcpy_gbs"]
    row["get_ratio"] = row["get_gbs"] / row["memcpy_gbs"]
    return row


def start_redis(workdir: Path):
    binary = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        return None, "python package 'redis' missing (pip install -e '.[bench]')"
    if binary is None:
        return None, "redis-server not installed (apt-get install redis-server)"
    sock = workdir / "redis.sock"
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--maxmemory", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(unix_socket_path=str(sock))
    for _ in range(100):
        try:
            client.ping()
            return (proc, client), ""
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None, "redis-server did not start"


def bench_redis(client, size: int, rounds: int, batch_bytes: int) -> tuple[float, float]:
    count = item_count(size, batch_bytes)
    payloads = [os.urandom(size) for _ in range(min(count, 8))]
    put_s = get_s = 0.0
    for r in range(rounds):
        keys = [f"{size}-{r}-{i}" for i in range(count)]
        pipe = client.pipeline(transaction=False)
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            pipe.set(k, payloads[i % len(payloads)])
        pipe.execute()
        t1 = time.perf_counter()
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        t2 = time.perf_counter()
        assert all(len(g) == size for g in got)
        client.delete(*keys)
        put_s += t1 - t0
        get_s += t2 - t1
    return count * size * rounds / put_s / 1e9, count * size * rounds / get_s / 1e9


ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER); s.bind(sys.argv[1])
while True:
    s.send_multipart(s.recv_multipart())
"""


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def round_trips(address: str, n: int, warmup: int = 200) -> tuple[float, float]:
    """p50/p99 seconds of ``n`` PING round trips (after a warm-up) to whatever serves ``address``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 7})
    samples = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        sock.send(frame)
        while msgpack.unpackb(sock.recv_multipart()[0])["id"] != 7:
            pass  # the daemon's id-0 liveness probes
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    sock.close(linger=0)
    return percentiles(samples)


def bench_raw_zmq(workdir: Path, n: int, warmup: int = 200) -> tuple[float, float]:
    address = f"ipc://{workdir / 'echo.sock'}"
    proc = subprocess.Popen([sys.executable, "-c", ECHO, address])
    try:
        return round_trips(address, n, warmup)
    finally:
        proc.kill()


def bench_lookup(session: Session, rounds: int, keys_stored: int = 2048) -> float:
    size = 4096
    stored = [f"lk-{i}".encode() for i in range(keys_stored)]
    for i in range(0, len(stored), 512):
        session.call(Op.PUT, items=[[k, 0, size] for k in stored[i:i + 512]])
    keys = stored + [f"absent-{i}".encode() for i in range(keys_stored)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        reply = session.call(Op.LOOKUP, keys=keys)
    elapsed = time.perf_counter() - t0
    assert sum(1 for t in reply["tiers"] if t) == len(stored)
    return len(keys) * rounds / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pings", type=int, default=5000)
    parser.add_argument("--json", default="benchmarks/results/cpu_roundtrip.json")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one round, no Redis: checks that every row runs")
    parser.add_argument("--sizes", default="",
                        help="comma-separated chunk sizes to run (default: all), e.g. 16KiB,64KiB")
    parser.add_argument("--nvme-bytes", default="0",
                        help="give the daemon an NVMe tier of this size below the CPU tier (its "
                             "PUTs then commit entries, as a default deployment's do); default 0")
    args = parser.parse_args()
    sizes, batch_bytes = (QUICK_SIZES, QUICK_BATCH_BYTES) if args.quick else (SIZES, BATCH_BYTES)
    if args.sizes:
        wanted = args.sizes.split(",")
        unknown = [w for w in wanted if w not in SIZES]
        if unknown:
            parser.error(f"--sizes: {unknown} unknown; allowed: {', '.join(SIZES)}")
        sizes = {w: SIZES[w] for w in wanted}
    rounds, pings, warmup = (1, 20, 5) if args.quick else (args.rounds, args.pings, 200)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    proc, address = start_daemon(workdir, "64MiB" if args.quick else "1GiB", args.nvme_bytes)
    redis_handle, redis_note = (None, "--quick") if args.quick else start_redis(workdir)
    results: dict = {"sizes": {}, "notes": [], "quick": args.quick, "nvme_bytes": args.nvme_bytes}
    stream = streaming_copy()
    if stream is None:
        results["notes"].append("stream skipped: kvtierd.copy._ranges is not built")
    try:
        session = Session(address, batch_bytes)
        for label, size in sizes.items():
            # memcpy right before the daemon, round by round: the ceiling of the same moment.
            row = bench_size(session, size, rounds, batch_bytes, stream)
            if redis_handle:
                row["redis_set_gbs"], row["redis_get_gbs"] = bench_redis(redis_handle[1], size,
                                                                         rounds, batch_bytes)
            results["sizes"][label] = row
        results["ping_p50_us"], results["ping_p99_us"] = (x * 1e6 for x in round_trips(address, pings, warmup))
        results["zmq_p50_us"], results["zmq_p99_us"] = (x * 1e6 for x in bench_raw_zmq(workdir, pings, warmup))
        results["lookup_keys_per_s"] = bench_lookup(session, 2 if args.quick else 50,
                                                    64 if args.quick else 2048)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        if redis_handle:
            redis_handle[0].kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if redis_note:
        results["notes"].append(f"redis skipped: {redis_note}")
    print_table(results)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nJSON: {args.json}")
    return 0


def print_table(r: dict) -> None:
    print(f"{'chunk':<8}{'PUT GB/s':>10}{'GET GB/s':>10}{'memcpy':>9}{'PUT/mc':>8}{'GET/mc':>8}"
          f"{'stream':>8}{'PUT/st':>8}"
          f"{'redis SET':>11}{'redis GET':>11}{'PUT/SET':>9}{'GET/GET':>9}"
          f"{'PUT/mc med':>12}{'GET/mc med':>12}")
    for label, row in r["sizes"].items():
        line = (f"{label:<8}{row['put_gbs']:>10.2f}{row['get_gbs']:>10.2f}{row['memcpy_gbs']:>9.2f}"
                f"{row['put_gbs'] / row['memcpy_gbs']:>7.2f}x{row['get_gbs'] / row['memcpy_gbs']:>7.2f}x")
        line += (f"{row['stream_gbs']:>8.2f}{row['put_gbs'] / row['stream_gbs']:>7.2f}x"
                 if "stream_gbs" in row else f"{'-':>8}{'-':>8}")
        if "redis_set_gbs" in row:
            line += (f"{row['redis_set_gbs']:>11.2f}{row['redis_get_gbs']:>11.2f}"
                     f"{row['put_gbs'] / row['redis_set_gbs']:>8.1f}x"
                     f"{row['get_gbs'] / row['redis_get_gbs']:>8.1f}x")
        else:
            line += f"{'-':>11}{'-':>11}{'-':>9}{'-':>9}"
        line += f"{row['put_ratio_median']:>11.2f}x{row['get_ratio_median']:>11.2f}x"
        print(line)
    print("PUT/mc, GET/mc: the daemon's mean over the rounds against the best memcpy round; med: "
          "the median of each round's own ratio (the rounds interleave memcpy, PUT and GET)")
    print(f"\nPING p50 {r['ping_p50_us']:.1f} us  p99 {r['ping_p99_us']:.1f} us   raw ZeroMQ p50 "
          f"{r['zmq_p50_us']:.1f} us  p99 {r['zmq_p99_us']:.1f} us   ratio p50 "
          f"{r['ping_p50_us'] / r['zmq_p50_us']:.2f}x")
    print(f"batched LOOKUP: {r['lookup_keys_per_s'] / 1e3:.0f}k keys/s")
    for note in r["notes"]:
        print("note:", note)


if __name__ == "__main__":
    raise SystemExit(main())
