"""Root-only kernel set-ups for the trust-boundary tests, each undone on exit: a memory cgroup
around a process (cgroup v2 where it has the memory controller, else v1's memory hierarchy) and
reserved huge pages."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import Iterator

CGROUP_ROOT = Path("/sys/fs/cgroup")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


class MemoryCgroup:
    """A child memory cgroup of this process's own, with a limit."""

    def __init__(self, path: Path, v2: bool) -> None:
        self.path = path
        self.v2 = v2

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v2 if self.v2 else v1)

    def add(self, pid: int) -> None:
        self._file("cgroup.procs", "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def limit(self, nbytes: int) -> None:
        self._file("memory.limit_in_bytes", "memory.max").write_text(str(nbytes))

    def oom_kills(self) -> int:
        """OOM kills in this cgroup (v2: memory.events oom_kill; v1: memory.oom_control)."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


def _own_memory_cgroup() -> tuple[Path, bool]:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        return CGROUP_ROOT / path.lstrip("/"), True
    for line in lines:
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/"), False
    raise RuntimeError("no memory cgroup controller on this machine (neither v2 nor v1)")


@contextlib.contextmanager
def memory_cgroup() -> Iterator[MemoryCgroup]:
    """A fresh child memory cgroup (no limit yet); removed on exit once its processes are gone."""
    parent, v2 = _own_memory_cgroup()
    if v2:  # a v2 child gets the memory controller only if its parent delegates it
        control = parent / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            control.write_text("+memory")
    path = parent / f"kvt9-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        yield MemoryCgroup(path, v2)
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                path.rmdir()
                break
            except OSError:  # EBUSY while a process is still in it
                time.sleep(0.1)


@contextlib.contextmanager
def huge_pages(count: int) -> Iterator[int]:
    """At least ``count`` free 2 MiB huge pages reserved (nr_hugepages raised, restored on exit);
    yields the huge page size in bytes."""
    before = int(NR_HUGEPAGES.read_text())
    NR_HUGEPAGES.write_text(str(before + count))
    try:
        free = _meminfo("HugePages_Free")
        if free < count:
            raise RuntimeError(f"the kernel reserved {free} of the {count} huge pages asked for "
                               "(not enough contiguous memory?)")
        yield _meminfo("Hugepagesize") * 1024
    finally:
        NR_HUGEPAGES.write_text(str(before))


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
