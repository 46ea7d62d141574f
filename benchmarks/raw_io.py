"""The raw-device ceilings of the NVMe benchmark: sequential O_DIRECT writes and reads of the same
bytes in the same directory, with ``fio`` or, without it, Python threads (``benchmarks/nvme_tier.py``).
Run as a script's sibling (``benchmarks/`` is on ``sys.path``)."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import threading
import time
from pathlib import Path

import disk_stats


def raw_fio(directory: Path, size: int, total: int, jobs: int) -> dict:
    """fio's sequential O_DIRECT write then read of ``total`` bytes in ``size`` blocks, ``jobs``
    in flight. fio's bandwidth leaves out its final fsync, so as a ceiling it is strict: the
    daemon's demotion time includes its fdatasyncs and index commits."""
    per_job = max(size, total // jobs // size * size)
    common = ["fio", "--name=raw", f"--directory={directory}", "--filename_format=raw.$jobnum",
              f"--bs={size}", f"--size={per_job}", f"--numjobs={jobs}", "--direct=1",
              "--ioengine=psync", "--group_reporting", "--output-format=json"]
    out = {}
    dev = disk_stats.stat_path(directory)
    try:
        for rw, extra in (("write", ["--end_fsync=1"]), ("read", [])):
            before = disk_stats.read(dev)
            done = subprocess.run(common + [f"--rw={rw}"] + extra, capture_output=True,
                                  text=True, check=True)
            after = disk_stats.read(dev)
            job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0][rw]
            # fio's own I/O time (its start-up and layout left out), as the daemon's phases are
            out[f"{rw}_disk"] = disk_stats.delta(before, after, job["runtime"] / 1000.0)
            out[f"{rw}_gbs"] = job["bw_bytes"] / 1e9
    finally:
        for f in directory.glob("raw.*"):
            f.unlink()
    out.update(tool="fio (psync, direct=1, end_fsync=1)", bytes=per_job * jobs)
    return out


def raw_python(directory: Path, size: int, total: int, jobs: int) -> dict:
    """The same as raw_fio with os.pwritev/os.preadv threads on page-aligned buffers; the write
    time includes the final fdatasync."""
    per_job = max(1, total // jobs // size)  # blocks per job
    path = directory / "raw.data"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, per_job * jobs * size)
        buffers = []
        for _ in range(jobs):
            buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
            buf.write(os.urandom(size))
            buffers.append(buf)

        dev = disk_stats.stat_path(directory)
        disk = {}

        def run(op) -> float:
            barrier = threading.Barrier(jobs + 1)

            def job(j: int) -> None:
                barrier.wait()
                base = j * per_job * size
                for b in range(per_job):
                    done = op(fd, [buffers[j]], base + b * size)
                    assert done == size, f"short I/O: {done} of {size}"

            threads = [threading.Thread(target=job, args=(j,)) for j in range(jobs)]
            for t in threads:
                t.start()
            before = disk_stats.read(dev)  # before any job can start
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            if op is os.pwritev:
                os.fdatasync(fd)
            elapsed = time.perf_counter() - t0
            disk["write_disk" if op is os.pwritev else "read_disk"] = disk_stats.delta(
                before, disk_stats.read(dev), elapsed)
            return elapsed

        write_s = run(os.pwritev)
        read_s = run(os.preadv)
        for buf in buffers:
            buf.close()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    nbytes = per_job * jobs * size
    return {"tool": "python O_DIRECT pwritev/preadv threads", "bytes": nbytes,
            "write_gbs": nbytes / write_s / 1e9, "read_gbs": nbytes / read_s / 1e9, **disk}
