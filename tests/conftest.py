"""Shared fixtures: a real ``kvtierd serve`` process on a private ipc socket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers as a plain package

from helpers.daemon import DaemonProcess  # noqa: E402

LAYOUTS_DIR = Path(__file__).parent / "data" / "layouts"


@pytest.fixture
def daemon_factory(tmp_path):
    """Start daemons with extra flags; each is stopped (SIGTERM) and checked at teardown."""
    started: list[DaemonProcess] = []

    def start(*flags: str, **kwargs) -> DaemonProcess:
        proc = DaemonProcess(tmp_path / f"d{len(started)}", list(flags), **kwargs)
        proc.start()
        started.append(proc)
        return proc

    yield start
    failures: list[BaseException] = []
    for proc in started:  # every daemon is stopped, even after another one's check failed
        try:
            proc.stop_and_verify()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others
            failures.append(exc)
        finally:
            proc.remove_nvme_data()
    if failures:
        raise failures[0]


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()
