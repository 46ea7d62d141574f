"""The client's staging buffer: a sealed, fully allocated memfd with no name, that the daemon's
own checks (kvtierd.staging.verify_memfd) accept as it is."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier_client.staging import MemfdStagingBuffer
from kvtierd.staging import verify_memfd

NBYTES = 3 * 1024 * 1024 + 4096


def test_staging_is_sealed_allocated_and_accepted_by_the_daemon_checks():
    before = sorted(Path("/dev/shm").iterdir())
    buf = MemfdStagingBuffer(NBYTES)
    try:
        assert sorted(Path("/dev/shm").iterdir()) == before, "staging must have no /dev/shm name"
        seals = fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS)
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals == wanted, seals
        info = os.fstat(buf.fd)
        assert info.st_size == NBYTES and info.st_blocks * 512 >= NBYTES
        assert os.lseek(buf.fd, 0, os.SEEK_HOLE) == NBYTES, "a page was left a hole"
        for size in (0, NBYTES - 1, NBYTES + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(buf.fd, size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(buf.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert verify_memfd(buf.fd, NBYTES, NBYTES, (0, 0)) == NBYTES
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
