"""The connection cap in force under an RLIMIT_NOFILE: it always leaves the daemon's reserve and a
headroom of the cap again, so that libzmq's ipc accept never meets EMFILE."""

from __future__ import annotations

import pytest

from kvtierd.server.connections import FD_RESERVE, connection_limit


@pytest.mark.parametrize("nofile", [1024, 4096, 20000, 65536, 524288, 1 << 20])
def test_cap_leaves_reserve_sessions_and_headroom(nofile):
    limit = connection_limit(4096, nofile)
    assert 1 <= limit <= 4096
    assert FD_RESERVE + 3 * limit <= nofile


def test_configured_value_kept_when_it_fits():
    assert connection_limit(100, 65536) == 100


def test_lowered_under_a_small_limit():
    assert connection_limit(4096, 1024) == (1024 - FD_RESERVE) // 3
    assert connection_limit(4096, 100) == 1
