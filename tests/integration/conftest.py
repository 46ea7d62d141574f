"""Fixtures of the bad-input tests (test_bad_input_*.py): staging buffer and session factories
that clean up, and two module-scoped daemons (default and small limits)."""

from __future__ import annotations

import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from helpers.bad_input import LIMITS_TOML, Session, start_daemon, write_toml
from helpers.daemon import DaemonProcess
from helpers.handshake import MemfdBuffer


@pytest.fixture
def memfd() -> Iterator[Callable[..., MemfdBuffer]]:
    """Factory of memfd staging buffers (``MemfdBuffer``); every one is unmapped and closed at
    teardown."""
    made: list[MemfdBuffer] = []

    def make(nbytes: int, fill: int = 0, **options: Any) -> MemfdBuffer:
        buf = MemfdBuffer(nbytes, fill, **options)
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()


@pytest.fixture
def sessions() -> Iterator[Callable[..., Session]]:
    made: list[Session] = []

    def make(*args: Any, **kwargs: Any) -> Session:
        s = Session(*args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[DaemonProcess]:
    """One daemon (64 MiB tier, 64 KiB pages, default limits) for the cases that cannot hurt it."""
    d = start_daemon(tmp_path_factory.mktemp("bad-input"), "shared")
    yield d
    d.stop_and_verify()
    d.remove_nvme_data()


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[DaemonProcess]:
    """A daemon with small header, inline and batch limits from a TOML config file."""
    root = tmp_path_factory.mktemp("bad-input-limits")
    config = write_toml(root / "limits.toml", LIMITS_TOML)
    d = start_daemon(root, "limited", "--config", str(config))
    yield d
    d.stop_and_verify()
    d.remove_nvme_data()


@pytest.fixture
def users() -> Iterator[Callable[[], pwd.struct_passwd]]:
    """Factory of throwaway users (``useradd``, random ``kvt9`` names so parallel runs never
    collide), each removed with its group at teardown."""
    made: list[str] = []

    def make() -> pwd.struct_passwd:
        name = f"kvt9{secrets.token_hex(3)}"
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True,
                       capture_output=True)
        made.append(name)
        return pwd.getpwnam(name)

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], capture_output=True)
            subprocess.run(["groupdel", name], capture_output=True)


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A directory other users may traverse (pytest's tmp dirs are private to root)."""
    root = Path(tempfile.mkdtemp(prefix="kvt9-"))
    root.chmod(0o711)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
