"""Fixtures of the bad-input tests (test_bad_input_*.py): staging buffer and session factories
that clean up, and two module-scoped daemons (default and small limits)."""

from __future__ import annotations

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
