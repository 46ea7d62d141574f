"""The remote tier's loop-thread bookkeeping (no store needed: no job is run here)."""

from __future__ import annotations

from kvtierd.config_remote import RemoteConfig
from kvtierd.protocol import Status
from kvtierd.remote.tier import ABSENT_TTL_S, RemoteTier


class NoArena:  # bookkeeping never touches the arena; jobs (not run here) would
    address = 0
    nbytes = 0


def tier(**kw) -> RemoteTier:
    return RemoteTier(RemoteConfig(**kw), NoArena(), 65536)


def key(i: int):
    return (("uid:1", "ns", 0), b"k%d" % i)


def test_absent_answers_are_trusted_for_a_while_then_asked_again() -> None:
    t = tier()
    now = [100.0]
    t.clock = lambda: now[0]
    keys = [key(0), key(1)]
    assert t.unknown(keys, "fp") == keys
    t.exists_done(keys, "fp", [True, False])
    assert t.lookup(key(0), "fp")[0] is Status.OK
    assert t.lookup(key(0), "other-layout") == (Status.MISS, None)
    assert t.unknown([key(1)], "fp") == []
    now[0] += ABSENT_TTL_S + 0.01
    assert t.unknown([key(1)], "fp") == [key(1)]
    t.check_invariants()


def test_known_names_are_bounded_and_a_pending_write_is_never_checked() -> None:
    t = tier(known_keys=2)
    t.exists_done([key(i) for i in range(3)], "fp", [True] * 3)
    assert t.stats()["chunks"] == 2
    assert t.lookup(key(0), "fp") == (Status.MISS, None)  # forgotten: asked again next time
    target = t.reserve(key(5), "fp", 1000, b"\x00" * 16)
    assert target is not None and t.reserve(key(5), "fp", 1000, b"") is None
    assert t.unknown([key(5)], "fp") == [] and t.delete(key(5)) is Status.BUSY
    t.commit(target)
    assert t.peek(key(5)) is target and t.holds(key(5), b"\x00" * 16)
    assert t.delete(key(5)) is Status.OK and t.take_deletions() == [target]
    t.check_invariants()
