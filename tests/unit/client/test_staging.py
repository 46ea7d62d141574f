"""Staging files: private to the engine's user, or shared with the daemon's group on request."""

from __future__ import annotations

import grp
import os
import stat

import pytest

from kvtier_client.staging import STAGING_GROUP_ENV, ShmStagingBuffer, staging_group


def mode_and_gid(buf: ShmStagingBuffer) -> tuple[int, int]:
    info = os.stat(buf.path)
    return stat.S_IMODE(info.st_mode), info.st_gid


def test_private_by_default(monkeypatch):
    monkeypatch.delenv(STAGING_GROUP_ENV, raising=False)
    buf = ShmStagingBuffer(4096)
    try:
        assert mode_and_gid(buf) == (0o600, os.getegid())
    finally:
        buf.close()


def test_staging_group_makes_the_file_group_read_write(monkeypatch):
    gid = os.getgroups()[-1] if os.getgroups() else os.getegid()
    monkeypatch.setenv(STAGING_GROUP_ENV, str(gid))
    old = os.umask(0o077)  # the group bits survive even a strict umask
    try:
        buf = ShmStagingBuffer(4096)
    finally:
        os.umask(old)
    try:
        assert mode_and_gid(buf) == (0o660, gid)
    finally:
        buf.close()
    assert not buf.path.exists()


def test_group_names_resolve_and_unknown_names_fail_loudly():
    name = grp.getgrgid(os.getegid()).gr_name
    assert staging_group({STAGING_GROUP_ENV: name}) == os.getegid()
    assert staging_group({STAGING_GROUP_ENV: " 4242 "}) == 4242
    assert staging_group({}) is None and staging_group({STAGING_GROUP_ENV: ""}) is None
    with pytest.raises(ValueError, match="no such group"):
        staging_group({STAGING_GROUP_ENV: "no-such-group-kvtier"})
