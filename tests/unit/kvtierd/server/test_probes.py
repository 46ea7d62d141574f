"""ProbeSchedule: one probe round per interval however many disconnects, until one round has run
past the window of the latest disconnect."""

from __future__ import annotations

from kvtierd.server.probes import PROBE_INTERVAL_S, PROBE_WINDOW_S, ProbeSchedule


def test_no_disconnect_no_round():
    schedule = ProbeSchedule()
    assert schedule.due(100.0) is None


def test_a_burst_of_disconnects_is_one_round_per_interval():
    schedule = ProbeSchedule()
    for i in range(20_000):
        schedule.disconnected(100.0 + i * 1e-6)
    latest = 100.0 + 19_999 * 1e-6
    assert schedule.due(100.02) == latest
    assert schedule.due(100.03) is None  # within the interval
    rounds = [t for t in (100.02 + k * 0.05 for k in range(1, 60)) if schedule.due(t) is not None]
    assert schedule.rounds == 1 + len(rounds)
    # rounds are spaced by the interval, and stop once one ran past the window
    assert all(b - a >= PROBE_INTERVAL_S - 1e-9 for a, b in zip(rounds, rounds[1:]))
    assert rounds[-1] > latest + PROBE_WINDOW_S
    assert len(rounds) <= PROBE_WINDOW_S / PROBE_INTERVAL_S + 1
    assert schedule.due(200.0) is None


def test_a_later_disconnect_restarts_the_rounds_and_reports_its_time():
    schedule = ProbeSchedule()
    schedule.disconnected(10.0)
    assert schedule.due(10.0) == 10.0
    for t in (10.2, 10.4, 10.6, 10.8, 11.0, 11.2):
        schedule.due(t)
    assert schedule.due(20.0) is None
    schedule.disconnected(30.0)
    schedule.disconnected(29.0)  # reported late: the latest stays 30.0
    assert schedule.due(30.1) == 30.0
