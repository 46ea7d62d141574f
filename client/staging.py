"""The client's host staging buffer: a shared-memory file the daemon maps (CPU-only path).

The file is created under /dev/shm with a random name, announced in HELLO, and unlinked as soon
as the daemon has mapped it: from then on the memory lives exactly as long as either side maps it,
so a ``kill -9`` of the worker or of the daemon leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
ALIGN = 256  # unit offsets in staging: enough for 16-byte vector copies and DMA-friendly


class ShmStagingBuffer:
    def __init__(self, nbytes: int, mode: int = 0o600) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging_bytes={nbytes}; allowed: a positive size")
        self.name = f"kvtier-stg-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
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


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
