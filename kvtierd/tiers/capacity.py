"""Does an arena of ``cpu_bytes`` fit here? Checked at start, before anything is mapped.

Two limits bind a shared-memory arena, and neither is visible to ``mmap``: the size of the tmpfs
behind /dev/shm (Docker gives a container 64 MiB by default; Kubernetes pods get what an
``emptyDir: {medium: Memory}`` allows) and the memory the daemon may use (RAM, or the cgroup's
``memory.max`` in a container: shm pages are charged to the cgroup that touches them). Past either,
the kernel answers a page fault with SIGBUS or the OOM killer, long after a start that looked fine.
So the start refuses, naming both numbers and the setting that fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtierd.sizes import format_size

# Beyond the arena: the persistent index files in /dev/shm and, for the memory limit, the daemon's
# own heap and the clients' staging memfds it maps (64 MiB each by default; shared memory charged
# to whoever touches it first).
HEADROOM_BYTES = 64 * 1024**2
# cgroup v2 first (a container sees its own cgroup at the root), then v1.
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"),
                      Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-aligned LONG_MAX


class CapacityError(RuntimeError):
    """The arena cannot fit; the message names the numbers and the fix."""


def shm_free_bytes(shm_dir: Path) -> tuple[int, int]:
    """(free, total) bytes of the filesystem behind ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def memory_limit_bytes() -> tuple[int, str]:
    """The smaller of physical RAM and the cgroup memory limit, and where it comes from."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < min(ram, UNLIMITED):
            return int(text), f"the cgroup memory limit ({path})"
        break  # the first file that exists is this system's cgroup version
    return ram, "physical RAM"


def check_arena_fits(nbytes: int, shm_dir: Path, reusable_bytes: int = 0) -> None:
    """Raise CapacityError unless ``nbytes`` (+ headroom) fits in ``shm_dir`` and in memory.
    ``reusable_bytes``: blocks of an existing arena file this start will reuse (counted free)."""
    need = nbytes + HEADROOM_BYTES
    free, total = shm_free_bytes(shm_dir)
    free += reusable_bytes
    if need > free:
        raise CapacityError(
            f"cpu_bytes = {format_size(nbytes)} (+ {format_size(HEADROOM_BYTES)} headroom) does "
            f"not fit in {shm_dir}: {format_size(free)} free of {format_size(total)}. Give "
            f"{shm_dir} more space (docker run --shm-size={_suggest(need)}; Kubernetes: mount an "
            f"emptyDir {{medium: Memory, sizeLimit: {_suggest(need, 'Gi')}}} at {shm_dir}) or "
            f"lower cpu_bytes.")
    limit, source = memory_limit_bytes()
    if need > limit:
        raise CapacityError(
            f"cpu_bytes = {format_size(nbytes)} (+ {format_size(HEADROOM_BYTES)} headroom) "
            f"exceeds {source}: {format_size(limit)}. Raise the limit (docker run --memory; "
            f"Kubernetes resources.limits.memory) or lower cpu_bytes.")


def _suggest(nbytes: int, unit: str = "g") -> str:
    """A round size at least ``nbytes``, in GiB, as docker / Kubernetes spell it."""
    return f"{-(-nbytes // 1024**3)}{unit}"
