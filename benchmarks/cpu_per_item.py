"""CPU the daemon spends per PUT / GET / DELETE item of small chunks: its request loop thread, and
all its threads (loop + copy threads), in µs per item, read from ``/proc/<pid>/task/*/schedstat``.

    .venv/bin/python benchmarks/cpu_per_item.py [--compare DIR] [--rounds N] [--json out.json]
                                                [--quick]

Why CPU time and not throughput: at 16 KiB the daemon is bound by its Python per item, and on a
shared machine a wall-clock rate mostly measures the neighbours; CPU time per item barely moves
with the load, so a before/after is readable on a busy box. (The throughput against memcpy is
``cpu_roundtrip.py``'s job.)

Each round does, per chunk size, one PUT of a batch (staging already filled, 4096 items or 64 MiB),
one GET of the same keys and one DELETE of them, on a daemon without an NVMe tier (the CPU path).
With ``--compare DIR`` a second daemon runs the kvtierd found in DIR (e.g. a checkout of main) and
the two are driven alternately, round by round, so both see the same machine, and which of them
goes first alternates too. DIR may speak protocol 1 (staging named in HELLO: the code issue 12
was measured on, ``f266b65``); the session is chosen from its ``kvtierd/protocol.py``. The first round is a warm-up. ``--quick`` runs tiny batches so that a
test checks the output's shape; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
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
from raw_session import Session, session_for

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"16KiB": 16 * 1024, "64KiB": 64 * 1024}
BATCH_BYTES = 64 * 1024**2
MAX_ITEMS = 4096
QUICK_BATCH_BYTES = 1024**2
OPS = ("put", "get", "delete")


def thread_cpu_s(pid: int, tid: int) -> float:
    """Seconds ``tid`` of ``pid`` has run on a CPU (schedstat: nanoseconds, first field)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def threads_cpu_s(pid: int) -> dict[int, float]:
    """One reading of every thread of ``pid``: tid -> seconds on a CPU. The loop thread's figure and
    the all-threads sum come from this same reading, so "all" can never fall below "loop" (two
    separate readings could: the loop thread runs between them)."""
    seen = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            seen[int(tid)] = thread_cpu_s(pid, int(tid))
        except FileNotFoundError:  # a thread that just ended
            pass
    return seen


def cpu_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU the threads alive at ``after`` spent since ``before`` (a new thread counts from zero; a
    thread that ended in between is lost, so this is a lower bound, never below the loop's own)."""
    return sum(t - before.get(tid, 0.0) for tid, t in after.items())


def start_daemon(code_dir: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    """A daemon running the kvtierd package found in ``code_dir`` (its cwd: first on sys.path)."""
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "serve", "--socket", address, "--cpu-bytes", "1GiB",
         "--nvme-bytes", "0", "--metrics-addr", "off", "--log-level", "WARNING"], cwd=code_dir)
    probe = zmq.Context.instance().socket(zmq.DEALER)
    probe.connect(address)
    probe.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 1}))
    deadline = time.monotonic() + 60
    while not probe.poll(200):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"kvtierd from {code_dir} did not start")
    probe.close(linger=0)
    return proc, address


def one_round(proc: subprocess.Popen, session: Session, size: int, count: int, tag: str
              ) -> dict[str, tuple[float, float]]:
    """PUT, GET, DELETE of ``count`` chunks: per op (loop thread µs, all threads µs) per item."""
    keys = [f"{tag}-{size}-{i}".encode() for i in range(count)]
    items = [[key, i * size, size] for i, key in enumerate(keys)]
    out = {}
    for op, fields in (("put", {"items": items}), ("get", {"items": items}),
                       ("delete", {"keys": keys})):
        before = threads_cpu_s(proc.pid)
        reply = session.call(Op[op.upper()], **fields)
        after = threads_cpu_s(proc.pid)
        if any(reply["results"]):
            raise RuntimeError(f"{op} of {tag} failed: {reply['results'][:8]}")
        loop_s = after[proc.pid] - before[proc.pid]
        out[op] = (loop_s / count * 1e6, cpu_delta_s(before, after) / count * 1e6)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, default=None,
                        help="a second kvtierd checkout (e.g. main) driven alternately")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default="benchmarks/results/cpu_per_item.json")
    parser.add_argument("--quick", action="store_true", help="tiny batches: a smoke test")
    args = parser.parse_args()
    batch_bytes = QUICK_BATCH_BYTES if args.quick else BATCH_BYTES
    rounds = 2 if args.quick else max(2, args.rounds)
    codes = {"this": ROOT} | ({"compare": args.compare.resolve()} if args.compare else {})
    daemons, sessions, dirs = {}, {}, []
    results: dict = {"quick": args.quick, "rounds": rounds - 1, "codes": {k: str(v) for k, v in
                                                                         codes.items()}, "rows": {}}
    try:
        for name, code in codes.items():
            work = Path(tempfile.mkdtemp(prefix="kvtier-cpi-"))
            dirs.append(work)
            daemons[name] = start_daemon(code, work)
            sessions[name] = session_for(code, daemons[name][1], batch_bytes)
        samples: dict = {}
        for r in range(rounds):
            for label, size in SIZES.items():
                count = max(1, min(MAX_ITEMS, batch_bytes // size))
                # Neither daemon keeps a fixed place in the round: the order alternates.
                for name in (list(codes) if r % 2 else list(codes)[::-1]):
                    got = one_round(daemons[name][0], sessions[name], size, count, f"r{r}")
                    if r == 0:
                        continue  # warm-up: first allocations, first page faults
                    row = samples.setdefault(f"{name} {label}", {})
                    for op, (loop_us, all_us) in got.items():
                        row.setdefault(f"{op}_loop_us", []).append(loop_us)
                        row.setdefault(f"{op}_all_us", []).append(all_us)
        for row_name, row in samples.items():
            results["rows"][row_name] = {k: statistics.median(v) for k, v in row.items()} | {
                "samples": row}
    finally:
        for session in sessions.values():
            session.close()
        for proc, _ in daemons.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        for work in dirs:
            shutil.rmtree(work, ignore_errors=True)
    cols = [f"{op}_{kind}_us" for kind in ("loop", "all") for op in OPS]
    print(f"{'daemon / chunk':<18}" + "".join(f"{c.replace('_us', ''):>14}" for c in cols)
          + "   (µs CPU per item, median)")
    for row_name, row in results["rows"].items():
        print(f"{row_name:<18}" + "".join(f"{row[c]:>14.2f}" for c in cols))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
