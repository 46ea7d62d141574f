"""The client's host staging buffer: a shared-memory file the daemon maps (CPU-only path).

The file is created under /dev/shm with a random name, announced in HELLO, and unlinked as soon
as the daemon has mapped it: from then on the memory lives exactly as long as either side maps it,
so a ``kill -9`` of the worker or of the daemon leaves nothing behind in /dev/shm.

The file is private to the engine's user (mode 0600) unless ``KVTIER_STAGING_GROUP`` names a group
(name or gid): then it belongs to that group with mode 0660, so that a daemon running as another
user in that group (the systemd unit's and the DaemonSet's ``kvtierd`` group) can map it, and no
one else can.
"""

from __future__ import annotations

import grp
import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
STAGING_GROUP_ENV = "KVTIER_STAGING_GROUP"
ALIGN = 256  # unit offsets in staging: enough for 16-byte vector copies and DMA-friendly


class ShmStagingBuffer:
    def __init__(self, nbytes: int, mode: int = 0o600, group: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging_bytes={nbytes}; allowed: a positive size")
        group = staging_group() if group is None else group
        self.name = f"kvtier-stg-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            if group is not None:
                os.fchown(fd, -1, group)
                os.fchmod(fd, 0o660)  # after the chown: the umask may have dropped group bits
            os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def handle(self) -> dict:
        return {"kind": "shm", "name": self.name, "nbytes": self.nbytes}

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.unlink()
        if not self._mmap.closed:
            del self.tensor
            self._mmap.close()


def staging_group(env: dict[str, str] | None = None) -> int | None:
    """The gid named by ``KVTIER_STAGING_GROUP`` (a group name or a number), or None."""
    value = (os.environ if env is None else env).get(STAGING_GROUP_ENV, "").strip()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"{STAGING_GROUP_ENV}={value!r}: no such group") from None


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
