"""The client's staging buffer: a sealed, fully allocated memfd with no name, that the daemon's
own checks (kvtierd.staging.verify_memfd) accept as it is, and that stays writable for us once the
daemon has sealed it F_SEAL_FUTURE_WRITE (kvtierd.staging.seal_mapped)."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier_client.staging import MemfdStagingBuffer
from kvtierd.staging import (
    DAEMON_SEALS,
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    _libc,
    seal_mapped,
    verify_memfd,
)

NBYTES = 3 * 1024 * 1024 + 4096


def test_staging_is_sealed_allocated_and_accepted_by_the_daemon_checks():
    before = sorted(Path("/dev/shm").iterdir())
    buf = MemfdStagingBuffer(NBYTES)
    try:
        assert sorted(Path("/dev/shm").iterdir()) == before, "staging must have no /dev/shm name"
        seals = fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS)
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # the daemon adds FUTURE_WRITE | SEAL
        assert seals == wanted, seals
        info = os.fstat(buf.fd)
        assert info.st_size == NBYTES and info.st_blocks * 512 >= NBYTES
        assert os.lseek(buf.fd, 0, os.SEEK_HOLE) == NBYTES, "a page was left a hole"
        for size in (0, NBYTES - 1, NBYTES + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(buf.fd, size)
        with pytest.raises(OSError) as refused:  # our own writable mapping exists
            fcntl.fcntl(buf.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert refused.value.errno == errno.EBUSY
        assert verify_memfd(buf.fd, NBYTES, NBYTES, (0, 0)) == NBYTES
        seal_mapped(buf.fd, NBYTES)  # what the daemon does once it has mapped the buffer
        assert fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS) == wanted | DAEMON_SEALS
        assert _libc.fallocate(buf.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == -1
        assert os.lseek(buf.fd, 0, os.SEEK_HOLE) == NBYTES, "a page was punched out"
        data = os.urandom(4096)
        buf.tensor[NBYTES - 4096:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert os.pread(buf.fd, 4096, NBYTES - 4096) == data, "the tensor is not the memfd"
        assert f"kvtier-staging-{os.getpid()}" in os.readlink(f"/proc/self/fd/{buf.fd}")
        fd = buf.fd
        buf.release_fd()
        assert buf.fd is None
        with pytest.raises(OSError):
            os.fstat(fd)
        assert bytes(buf.tensor[NBYTES - 4096:].numpy()) == data, "mapping lost with the fd"
    finally:
        buf.close()


def test_allocation_failure_is_a_clear_error_not_a_later_sigbus(tmp_path):
    # RLIMIT_FSIZE makes the allocation fail the way a full memory limit does, in a child process
    script = tmp_path / "alloc.py"
    script.write_text(textwrap.dedent("""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from kvtier_client.staging import MemfdStagingBuffer, StagingAllocationError
        try:
            MemfdStagingBuffer(4 << 20)
        except StagingAllocationError as exc:
            print("REFUSED", exc)
        else:
            print("ALLOCATED")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout
    assert "4194304-byte staging buffer" in out.stdout and "smaller staging_bytes" in out.stdout


def test_nonpositive_size_is_refused():
    with pytest.raises(ValueError, match="staging_bytes=0; allowed: a positive size"):
        MemfdStagingBuffer(0)
