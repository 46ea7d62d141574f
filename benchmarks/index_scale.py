"""The index at node scale: memory per indexed chunk, batched LOOKUP keys/s, restart to serving.

    .venv/bin/python benchmarks/index_scale.py [--chunks 1000000] [--put-chunks 100000] [--quick]

All through real ``kvtierd serve`` processes (4 KiB pages, no metrics exporter), in one run:

* **Memory per chunk, PUT path**: a daemon's private memory outside the arena and the staging
  mappings (``/proc/<pid>/smaps``: Private_Clean + Private_Dirty of every other mapping) before
  and after one session PUTs ``--put-chunks`` one-page chunks, divided by the chunks; then the
  same once the daemon was idle ``REST_S`` (it gives its heap's free pages back after a quiet
  housekeeping tick, at most every ``heap_trim.IdleTrim.min_interval_s``).
* **Memory per chunk at ``--chunks``**: a persistent arena's index (SQLite next to the arena in
  /dev/shm) is filled with ``--chunks`` rows (one real PUT gives the tenant; the other rows name
  distinct pages with random keys and checksums: the index is the subject here, their bytes are
  never read), the daemon restarts onto it, and its private memory is compared with the same
  daemon on an empty index.
* **Restart to serving** (warm arena, and NVMe): seconds from process start to the first PING
  answer with ``--chunks`` indexed, after a clean stop (SIGTERM: the start loads the index
  snapshot the stop wrote, target 1.5 s) and after SIGKILL (no snapshot: the start reads the
  rows, target 3 s; the first start after filling the rows reads them too), interleaved with
  starts on an empty index (``--repeat`` rounds, medians), and the clean stop's own seconds
  (it writes the snapshot); the ceiling is the empty-index start. Each start's log must say
  where its index came from, or the run fails. Both daemons
  started once, untimed, before (arena allocated, bytecode cached as an installed package has it,
  even under PYTHONDONTWRITEBYTECODE). The CPU seconds the process used until then are shown too:
  on a shared machine wall time mostly measures the other processes.
* **LOOKUP keys/s** for 1-, 64- and 1024-key batches of indexed keys against the daemon with
  ``--chunks`` indexed, each next to the same requests sent as PING (decoded and answered by the
  same loop, no index work): the transport's ceiling in the same run.

The NVMe tier needs ``--chunks`` pages of file (4 GiB at 1M): it goes in ``--nvme-root`` (default
the results directory), or in /dev/shm when that disk is short, or at a smaller count when
neither has room (the table says which). ``--quick`` runs tiny sizes (the smoke test): the output
has the same shape, its numbers mean nothing. ``--only lookup`` runs only the LOOKUP rows (one
untimed start on a ``--chunks`` index, no PUT path, restarts or NVMe) and prints the daemon's pid,
e.g. for ``py-spy record -p PID``. Results: a printed table and ``--json``.
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
import uuid
from pathlib import Path

import msgpack
import zmq

from kvtierd.protocol import PROTOCOL_VERSION, Op
from kvtierd.server.heap_trim import IdleTrim
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow

REPO = Path(__file__).resolve().parent.parent
PAGE = 4096
SHM = Path("/dev/shm")
TARGET_BYTES_PER_CHUNK = 256
#: Seconds idle before the PUT path's memory is read again: past the idle trim's interval.
REST_S = IdleTrim().min_interval_s + 1.0
TARGET_RESTART_S = 3.0
TARGET_SNAPSHOT_S = 1.5  # a clean restart (upgrade, config change) loads the index snapshot
TARGET_KEYS_PER_S = 1_000_000
BATCHES = (1, 64, 1024)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user + system, system) CPU seconds of ``pid`` so far: what a start costs on a machine
    other processes share (wall time there mostly measures the others); the kernel's part is
    mostly page faults (a 1M-chunk index is ~300 MB of fresh memory)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick


class Daemon:
    def __init__(self, workdir: Path, *flags: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.address = f"ipc://{workdir / 'kvtierd.sock'}"
        self.log_path = workdir / "daemon.log"
        self.args = [sys.executable, "-m", "kvtierd", "serve", "--socket", self.address,
                     "--page-bytes", str(PAGE), "--metrics-addr", "off", "--log-level", "INFO",
                     "--no-prefault", "--no-mlock", *flags]
        self.proc: subprocess.Popen | None = None
        self.start_cpu_s = 0.0  # CPU seconds the process used until its first PING answer
        self.start_sys_s = 0.0  # the kernel's part of them
        # Bytecode cached (in the work directory) as an installed package has it: a shell with
        # PYTHONDONTWRITEBYTECODE would otherwise compile every module at every start (~0.3 s).
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env["PYTHONPYCACHEPREFIX"] = str(workdir.parent / "pycache")

    def start(self, timeout_s: float = 300.0, expect: str = "") -> float:
        """Start; return seconds from the process start to its first PING answer. ``expect``:
        where the index must have come from ("rows", "snapshot": its start log line says)."""
        mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        wall = self._start(timeout_s)
        if expect:
            with open(self.log_path, "rb") as log:
                log.seek(mark)
                if f"chunks from {expect}".encode() not in log.read():
                    raise RuntimeError(f"this start did not load its index from {expect}:\n"
                                       f"{self.log_path.read_text()[mark:]}")
        return wall

    def _start(self, timeout_s: float) -> float:
        probe = zmq.Context.instance().socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.RECONNECT_IVL, 1)
        probe.connect(self.address)
        with open(self.log_path, "ab") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        try:
            probe.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 1}))
            while True:
                if probe.poll(2):
                    probe.recv_multipart()
                    wall = time.perf_counter() - started
                    self.start_cpu_s, self.start_sys_s = cpu_seconds(self.proc.pid)
                    return wall
                if self.proc.poll() is not None or time.perf_counter() - started > timeout_s:
                    raise RuntimeError(f"kvtierd did not start:\n{self.log_path.read_text()}")
        finally:
            probe.close(linger=0)

    def private_bytes(self) -> int:
        """Private memory outside shared-memory files (arena, its index) and memfds (staging)."""
        assert self.proc is not None
        total, counted = 0, True
        with open(f"/proc/{self.proc.pid}/smaps") as smaps:
            for line in smaps:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's header line
                    parts = line.split()
                    path = parts[5] if len(parts) > 5 else ""
                    counted = not (path.startswith(str(SHM)) or path.startswith("/memfd:"))
                elif counted and head in ("Private_Clean:", "Private_Dirty:"):
                    total += int(line.split()[1]) * 1024
        return total

    def stop(self) -> float:
        """SIGTERM (a clean stop: it writes the index snapshot); seconds until it exited."""
        seconds = 0.0
        if self.proc is not None and self.proc.poll() is None:
            started = time.perf_counter()
            self.proc.send_signal(signal.SIGTERM)
            if self.proc.wait(timeout=120) != 0:
                raise RuntimeError(f"kvtierd failed:\n{self.log_path.read_text()}")
            seconds = time.perf_counter() - started
        self.proc = None
        return seconds

    def kill(self) -> None:
        """SIGKILL, as a crash: no snapshot, the next start reads the rows."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=60)
        self.proc = None


def session(address: str, nbytes: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from raw_session import Session

    return Session(address, nbytes, namespace="bench", fingerprint="bench")


def put_chunks(sess, keys: list[bytes], batch: int = 1024) -> None:
    for i in range(0, len(keys), batch):
        items = [[k, 0, PAGE] for k in keys[i:i + batch]]
        results = sess.call(Op.PUT, items=items)["results"]
        bad = [r for r in results if r != 0]
        if bad:
            raise RuntimeError(f"PUT refused {len(bad)} chunks: {sorted(set(bad))}")


def fill_rows(db_path: Path, meta: dict[str, str], tenant: str, chunks: int, first_page: int,
              rng_seed: int) -> list[bytes]:
    """Add ``chunks`` rows naming pages ``first_page..``; return their keys."""
    import random

    rng = random.Random(rng_seed)
    db = ChunkIndexDB(db_path, meta, synchronous="OFF")
    keys = [rng.randbytes(32) for _ in range(chunks)]
    step = 50_000
    for i in range(0, chunks, step):
        db.insert(IndexRow(tenant, "bench", 0, keys[j], "bench", PAGE, rng.randbytes(16),
                           [(first_page + j, 1)]) for j in range(i, min(chunks, i + step)))
    db.close()
    return keys


def tenant_of(db_path: Path, meta: dict[str, str]) -> str:
    db = ChunkIndexDB(db_path, meta)
    try:
        rows = list(db.rows())
    finally:
        db.close()
    assert len(rows) == 1, rows
    return rows[0].tenant


def lookup_rate(address: str, keys: list[bytes], batch: int, seconds: float) -> tuple[float, float]:
    """(LOOKUP keys/s, the same requests as PING keys/s), interleaved in rounds."""
    sess = session(address, PAGE)
    try:
        rates: dict[str, list[float]] = {"lookup": [], "ping": []}
        rounds = 3
        for _ in range(rounds):
            for op, name in ((Op.LOOKUP, "lookup"), (Op.PING, "ping")):
                done, pos = 0, 0
                started = time.perf_counter()
                while time.perf_counter() - started < seconds / rounds / 2:
                    if pos + batch > len(keys):
                        pos = 0
                    reply = sess.call(op, keys=keys[pos:pos + batch])
                    if op is Op.LOOKUP and 0 in reply["tiers"]:
                        raise RuntimeError("an indexed key missed")
                    pos += batch
                    done += batch
                rates[name].append(done / (time.perf_counter() - started))
        return max(rates["lookup"]), max(rates["ping"])
    finally:
        sess.close()


def restart_times(indexed: Daemon, empty: Daemon, repeat: int) -> tuple[dict, float, float]:
    """Wall and CPU seconds to serving, interleaved per round: ``indexed`` from its rows (the
    first start after ``fill_rows``, later ones after a SIGKILL), its clean stop (which writes
    the snapshot), its start from that snapshot, and a start on an empty index; medians and
    every run. Also the private memory beyond the empty daemon's per chunk-count (bytes), after
    the last rows start and the last snapshot start. The indexed daemon is left running (from
    its snapshot)."""
    runs: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    empty.start()  # untimed: creates its arena (fallocate) and bytecode, as the indexed one has
    empty.stop()
    mem_rows = mem_snapshot = 0
    for n in range(repeat):
        last = n == repeat - 1
        for source in ("rows", "snapshot"):
            if source == "snapshot":
                add("stop", indexed.stop())
            add(source, indexed.start(expect=source))
            add(f"{source}_cpu", indexed.start_cpu_s)
            add(f"{source}_sys", indexed.start_sys_s)
            if last:
                private = indexed.private_bytes()
                mem_rows, mem_snapshot = (private, mem_snapshot) if source == "rows" else (
                    mem_rows, private)
        add("empty", empty.start())
        add("empty_cpu", empty.start_cpu_s)
        if last:
            mem_rows -= empty.private_bytes()
            mem_snapshot -= empty.private_bytes()
        empty.stop()
        if not last:
            indexed.kill()  # the next round's first start reads the rows
    med = statistics.median
    return {"restart_s": med(runs["rows"]), "empty_restart_s": med(runs["empty"]),
            "restart_cpu_s": med(runs["rows_cpu"]), "empty_restart_cpu_s": med(runs["empty_cpu"]),
            "restart_sys_s": med(runs["rows_sys"]), "restart_runs_s": runs["rows"],
            "restart_cpu_runs_s": runs["rows_cpu"], "restart_sys_runs_s": runs["rows_sys"],
            "snapshot_restart_s": med(runs["snapshot"]),
            "snapshot_restart_cpu_s": med(runs["snapshot_cpu"]),
            "snapshot_restart_sys_s": med(runs["snapshot_sys"]),
            "snapshot_restart_runs_s": runs["snapshot"],
            "snapshot_restart_cpu_runs_s": runs["snapshot_cpu"],
            "empty_restart_runs_s": runs["empty"],
            "stop_s": med(runs["stop"]), "stop_runs_s": runs["stop"]}, mem_rows, mem_snapshot


def room_pages(chunks: int) -> int:
    """Pages for ``chunks`` one-page chunks well below the default high watermark (0.95)."""
    return chunks * 5 // 4 + 64


def warm_arena(work: Path, chunks: int, repeat: int, lookup_s: float,
               lookup_only: bool = False) -> dict:
    name = f"kvtierd-bench-{uuid.uuid4().hex[:12]}"
    empty_name = f"{name}-empty"
    cpu = str(room_pages(chunks) * PAGE)  # below the high watermark: nothing is evicted
    meta = {"page_bytes": str(PAGE), "cpu_bytes": cpu}
    indexed = Daemon(work / "warm", "--cpu-persistent", "--arena-name", name, "--cpu-bytes", cpu,
                     "--nvme-bytes", "0")
    empty = Daemon(work / "warm-empty", "--cpu-persistent", "--arena-name", empty_name,
                   "--cpu-bytes", cpu, "--nvme-bytes", "0")
    try:
        indexed.start()
        sess = session(indexed.address, PAGE)
        put_chunks(sess, [os.urandom(32)])
        sess.close()
        indexed.stop()
        db_path = SHM / f"{name}.index"
        keys = fill_rows(db_path, meta, tenant_of(db_path, meta), chunks, 1, 1)
        if lookup_only:  # one untimed start: the LOOKUP rows alone (e.g. while profiling)
            indexed.start()
            print(f"daemon pid {indexed.proc.pid} serving {chunks} chunks", flush=True)
            result = {"chunks": chunks, "arenas": [name]}
        else:
            times, mem, mem_snapshot = restart_times(indexed, empty, repeat)
            result = {"chunks": chunks, **times, "bytes_per_chunk": mem / chunks,
                      "snapshot_bytes_per_chunk": mem_snapshot / chunks,
                      "arenas": [name, empty_name]}  # removed at the end (the smoke test checks)
        if lookup_s > 0:
            result["lookup"] = {str(b): dict(zip(("keys_per_s", "ping_keys_per_s"),
                                                 lookup_rate(indexed.address, keys, b, lookup_s)))
                                for b in BATCHES}
        return result
    finally:
        for d in (indexed, empty):
            d.stop()
        for path in SHM.glob(f"{name}*"):
            path.unlink()


def nvme_room(root: Path, chunks: int) -> tuple[Path, int]:
    """Where the NVMe file fits (with 25 % to spare), and how many chunks then."""
    need = (chunks + 64) * PAGE
    for place in (root, SHM):
        if shutil.disk_usage(place).free * 0.75 >= need:
            return place, chunks
    free = shutil.disk_usage(root).free
    return root, max(1000, int(free * 0.5) // PAGE - 64)


def nvme(work: Path, root: Path, chunks: int, repeat: int) -> dict:
    place, chunks = nvme_room(root, chunks)
    nvme_dir = Path(tempfile.mkdtemp(prefix="kvtierd-bench-nvme-", dir=place))
    empty_dir = Path(tempfile.mkdtemp(prefix="kvtierd-bench-nvme-empty-", dir=place))
    size = str((chunks + 64) * PAGE)  # no watermark below: a full file evicts only on demand
    indexed = Daemon(work / "nvme", "--cpu-bytes", "16MiB", "--nvme-bytes", size,
                     "--nvme-dir", str(nvme_dir))
    # The baseline's file is small: one file of the full size is what the machine can spare
    # (at a restart the preallocated file is only reopened, so its size barely matters).
    empty = Daemon(work / "nvme-empty", "--cpu-bytes", "16MiB", "--nvme-bytes", "64MiB",
                   "--nvme-dir", str(empty_dir))
    meta = {"page_bytes": str(PAGE), "nvme_bytes": size}
    try:
        indexed.start()
        indexed.stop()
        fill_rows(nvme_dir / "index.sqlite", meta, f"uid:{os.getuid()}", chunks, 0, 2)
        times, mem, mem_snapshot = restart_times(indexed, empty, repeat)
        return {"chunks": chunks, "dir": str(place), **times, "bytes_per_chunk": mem / chunks,
                "snapshot_bytes_per_chunk": mem_snapshot / chunks}
    finally:
        for d in (indexed, empty):
            d.stop()
        shutil.rmtree(nvme_dir, ignore_errors=True)
        shutil.rmtree(empty_dir, ignore_errors=True)


def put_path(work: Path, chunks: int, rest_s: float) -> dict:
    d = Daemon(work / "put", "--cpu-bytes", str((chunks + 64) * PAGE), "--nvme-bytes", "0")
    try:
        d.start()
        sess = session(d.address, PAGE)
        put_chunks(sess, [os.urandom(32)])  # the session's and the first batch's own memory
        before = d.private_bytes()
        started = time.perf_counter()
        put_chunks(sess, [os.urandom(32) for _ in range(chunks)])
        seconds = time.perf_counter() - started
        after = d.private_bytes()
        out = {"chunks": chunks, "bytes_per_chunk": (after - before) / chunks,
               "put_chunks_per_s": chunks / seconds}
        if rest_s > 0:  # the same daemon once idle: it gives its heap's free pages back
            time.sleep(rest_s)
            out["rest_bytes_per_chunk"] = (d.private_bytes() - before) / chunks
        sess.close()
        return out
    finally:
        d.stop()


def print_table(r: dict) -> None:
    """The rows of what ran (``--only`` runs a part)."""
    rows = []
    for name, what in (("put_path", "PUT path"), ("warm_arena", "warm arena"), ("nvme", "NVMe")):
        if "bytes_per_chunk" in r.get(name, {}):
            rows.append((f"memory per chunk, {what}", f"{r[name]['bytes_per_chunk']:.0f} B",
                         f"{r[name]['chunks']} chunks", f"<= {TARGET_BYTES_PER_CHUNK} B"))
        if "rest_bytes_per_chunk" in r.get(name, {}):
            rows.append((f"  the same, idle {REST_S:.0f} s (free heap pages returned)",
                         f"{r[name]['rest_bytes_per_chunk']:.0f} B", "", ""))
        if "snapshot_bytes_per_chunk" in r.get(name, {}):
            rows.append(("  the same, loaded from the snapshot",
                         f"{r[name]['snapshot_bytes_per_chunk']:.0f} B", "", ""))
    for name, what in (("warm_arena", "warm arena"), ("nvme", "NVMe")):
        if "restart_s" in r.get(name, {}):
            m = r[name]
            where = f" ({m['dir']})" if "dir" in m else ""
            empty = f"empty index {m['empty_restart_s']:.2f} s{where}"
            empty_cpu = f"empty index {m['empty_restart_cpu_s']:.2f} s"
            for label, key, target in (("clean stop (snapshot)", "snapshot_restart",
                                        TARGET_SNAPSHOT_S),
                                       ("after SIGKILL (rows)", "restart", TARGET_RESTART_S)):
                rows += [(f"restart to serving, {what}, {label}", f"{m[key + '_s']:.2f} s",
                          empty, f"<= {target} s"),
                         ("  CPU seconds of that start",
                          f"{m[key + '_cpu_s']:.2f} s ({m[key + '_sys_s']:.2f} s kernel)",
                          empty_cpu, "")]
            rows.append((f"  clean stop, {what} (writes the snapshot)", f"{m['stop_s']:.2f} s",
                         "", ""))
    for batch, m in r.get("warm_arena", {}).get("lookup", {}).items():
        rows.append((f"LOOKUP keys/s, {batch}-key batches", f"{m['keys_per_s']:,.0f}",
                     f"PING same requests {m['ping_keys_per_s']:,.0f} "
                     f"({m['keys_per_s'] / m['ping_keys_per_s']:.2f}x)",
                     f">= {TARGET_KEYS_PER_S:,}" if batch == "1024" else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    header = ("what", "kvtierd", "ceiling / context (same run)", "target")
    widths = [max(w_, len(h)) for w_, h in zip(widths, header)]
    for row in (header, *rows):
        print("  ".join(c.ljust(w_) for c, w_ in zip(row, widths)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--put-chunks", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3, help="restarts measured per index")
    ap.add_argument("--lookup-s", type=float, default=3.0, help="seconds per LOOKUP batch size")
    ap.add_argument("--nvme-root", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--only", choices=("all", "restart", "warm", "nvme", "lookup"), default="all",
                    help="restart: only the two restart rows (no PUT-path memory, no LOOKUP); "
                         "warm / nvme: only that restart row; lookup: only the LOOKUP rows "
                         "(one start on a --chunks index; prints the daemon's pid)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks/results/index_scale.json")
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.put_chunks, args.repeat, args.lookup_s = 3000, 2000, 1, 0.3
    results_dir = REPO / "benchmarks/results"
    results_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="index-scale-", dir=results_dir))
    try:
        result = {"quick": args.quick, "cpus": os.cpu_count()}
        if args.only == "all":
            result["put_path"] = put_path(work, args.put_chunks,
                                          0.0 if args.quick else REST_S)
        if args.only in ("all", "restart", "warm"):
            result["warm_arena"] = warm_arena(work, args.chunks, args.repeat,
                                              args.lookup_s if args.only == "all" else 0.0)
        if args.only == "lookup":
            result["warm_arena"] = warm_arena(work, args.chunks, 1, args.lookup_s,
                                              lookup_only=True)
        if args.only in ("all", "restart", "nvme"):
            result["nvme"] = nvme(work, args.nvme_root or results_dir, args.chunks, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
