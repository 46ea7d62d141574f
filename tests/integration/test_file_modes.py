"""The files a daemon creates reveal nothing to other local users: index files (and SQLite's -wal
and -shm) 0600, the arena 0600, the NVMe data and lock files 0600, the state directory 0700 (0750
when ``state_dir_mode`` grants the group) — whatever the umask, and older, wider files narrowed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from helpers.bad_input import names, write_toml
from helpers.nvme import InlineSession, payload

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def umask(mask: int):
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def fill(d) -> None:
    """Store enough that chunks reach NVMe, so every index file has been written."""
    with InlineSession(d.address, namespace="modes") as s:
        chunks = {b"m%02d" % i: payload(("modes", i), 300_000) for i in range(12)}
        assert names(s.put(chunks)) == ["OK"] * 12


def test_files_are_private_whatever_the_umask(daemon_factory):
    with umask(0o000):
        d = daemon_factory("--cpu-persistent", cpu_bytes="2MiB")
    fill(d)
    nvme = d.workdir / "nvme"
    files = {p.name: mode(p) for p in nvme.iterdir() if p.name != ".direct-io-probe"}
    assert {"index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "chunks.data",
            "kvtierd.lock"} <= set(files), files
    assert files == dict.fromkeys(files, "0o600"), files
    assert mode(nvme) == "0o700"
    shm = {p.name: mode(p) for p in d.shm_files()}
    arena = d.arena_name
    assert {arena, f"{arena}.index", f"{arena}.index-wal", f"{arena}.index-shm"} <= set(shm), shm
    assert shm == dict.fromkeys(shm, "0o600"), shm


def test_existing_wide_state_dir_is_narrowed_and_the_group_may_be_granted(daemon_factory,
                                                                           tmp_path):
    nvme = tmp_path / "d0" / "nvme"
    nvme.mkdir(parents=True, mode=0o755)
    nvme.chmod(0o755)
    (nvme / "index.sqlite").touch(mode=0o644)  # an empty file: SQLite makes it an index
    (nvme / "index.sqlite").chmod(0o644)
    d = daemon_factory()
    assert mode(nvme) == "0o700" and mode(nvme / "index.sqlite") == "0o600"
    assert "had mode 755; set to 700" in d.log()
    config = write_toml(tmp_path / "group.toml", 'state_dir_mode = "0750"\n')
    g = daemon_factory("--config", str(config))
    assert mode(g.workdir / "nvme") == "0o750"
