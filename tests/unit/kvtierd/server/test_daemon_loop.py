"""The request loop's sleep before its next housekeeping tick (kvtierd.server.daemon)."""

from __future__ import annotations

from kvtierd.server.daemon import poll_timeout_ms


def test_the_loop_never_polls_with_a_zero_timeout_before_its_tick_is_due():
    """Regression: the timeout was a float of milliseconds, which pyzmq truncates, so every
    iteration of the last millisecond before a tick polled with timeout 0 and spun."""
    assert poll_timeout_ms(10.0004, 10.0) == 1  # 0.4 ms left: sleep, not spin
    assert poll_timeout_ms(10.0, 10.0) == 0  # due now
    assert poll_timeout_ms(10.0, 10.5) == 0  # overdue
    assert poll_timeout_ms(10.1, 10.0) == 100
    assert all(poll_timeout_ms(10.0 + left / 1e6, 10.0) >= 1 for left in range(1, 1000))
    assert type(poll_timeout_ms(10.0004, 10.0)) is int
