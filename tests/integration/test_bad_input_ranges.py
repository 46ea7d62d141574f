"""Every field in its real range, for every op: extremes are answered BAD_REQUEST / OUT_OF_BOUNDS,
never reach SQLite, and hurt nobody. Plus the regression for the HELLO ``rank = 2**63`` attack,
which once poisoned the NVMe index connection (and, with --cpu-persistent, the arena index) for
every namespace.
"""

from __future__ import annotations

import pytest
from helpers.bad_input import bystander, item_errors, names, namespace
from helpers.nvme import InlineSession, payload
from helpers.handshake import inline_staging
from helpers.raw import RawClient

from kvtierd.protocol import Op, Tier

pytestmark = pytest.mark.timeout(120)

BIG = 2**62 + 1


def _hello(raw: RawClient, **fields) -> dict:
    base = {"namespace": namespace(), "rank": 0, "world_size": 1, "fingerprint": "fp",
            "staging": {"kind": "inline"}}
    reply, _ = raw.request(Op.HELLO, **{**base, **fields})
    return reply


@pytest.mark.parametrize("rank, world_size", [(2**63, 4096), (2**63, 1), (-1, 1), (-(2**63), 8),
                                              (0, 0), (0, 4097), (0, 2**63), (1, 1)])
def test_hello_rank_and_world_size_extremes_are_bad_request(shared, memfd, rank, world_size):
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            reply = _hello(raw, rank=rank, world_size=world_size)
            assert reply["name"] == "BAD_REQUEST", reply
            assert "rank" in reply["message"] or "world_size" in reply["message"], reply
            assert raw.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "NO_SESSION"
        finally:
            raw.close()


def test_item_extremes_of_an_inline_session_are_per_item_bad_requests(shared, memfd, sessions):
    with bystander(shared, memfd):
        s = sessions(shared.address, namespace())
        data = b"\x5a" * 1000
        items = [[b"off-neg", -1, 1000], [b"off-big", BIG, 1000], [b"off-bool", True, 1000],
                 [b"off-2**63", 2**63, 1000], [b"n-big", 0, BIG], [b"n-2**64-1", 0, 2**64 - 1],
                 [b"ok", 0, 1000]]
        frames = [data] * len(items)
        reply = s.put(items, frames)
        assert names(reply["results"]) == ["BAD_REQUEST"] * 6 + ["OK"], reply
        errors = item_errors(reply)
        assert "offset -1" in errors[0][1] and str(2**62) in errors[1][1], errors
        assert f"nbytes {BIG}" in errors[4][1], errors
        reply, payload_frames = s.get([[b"ok", -1, 1000], [b"ok", 0, BIG], [b"ok", 0, 1000]])
        assert names(reply["results"]) == ["BAD_REQUEST", "BAD_REQUEST", "OK"]
        assert payload_frames[2] == data and payload_frames[:2] == [b"", b""]


def test_staging_item_extremes_are_out_of_bounds_or_bad_request(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(65536)
        s = sessions(shared.address, namespace(), staging=buf)
        items = [[b"k", -1, 4096], [b"k", BIG, 4096], [b"k", 2**63, 4096], [b"k", 0, BIG],
                 [b"k", 0, -(2**63)]]
        reply = s.put(items)
        assert names(reply["results"]) == ["OUT_OF_BOUNDS"] * 3 + ["BAD_REQUEST"] * 2, reply
        reply, _ = s.get(items)
        assert names(reply["results"]) == ["OUT_OF_BOUNDS"] * 3 + ["BAD_REQUEST"] * 2, reply


@pytest.mark.parametrize("op, fields, fragment", [
    (Op.LOOKUP, {"keys": [b"k"], "lease": 1}, "'lease'"),
    (Op.LOOKUP, {"keys": [b"k"], "lease": "yes"}, "'lease'"),
    (Op.LOOKUP, {"keys": [b"x" * 100_000]}, "key of 100000 bytes"),
    (Op.LOOKUP, {"keys": [2**63]}, "not bytes"),
    (Op.LOOKUP, {"keys": "k"}, "'keys'"),
    (Op.PUT, {"items": [[b"k", 0]]}, "items[0]"),
    (Op.PUT, {"items": [b"k"]}, "items[0]"),
    (Op.GET, {"items": {"k": 1}}, "'items'"),
    (Op.DELETE, {"keys": None}, "'keys'"),
])
def test_request_field_extremes_are_refused_as_a_whole(shared, memfd, sessions, op, fields,
                                                       fragment):
    with bystander(shared, memfd):
        s = sessions(shared.address, namespace())
        reply, _ = s.request(op, **fields)
        assert reply["name"] in ("BAD_REQUEST", "KEY_TOO_LONG"), reply
        assert fragment in reply["message"], reply


def test_delete_of_bad_keys_answers_per_key(shared, memfd, sessions):
    with bystander(shared, memfd):
        s = sessions(shared.address, namespace())
        reply, _ = s.request(Op.DELETE, keys=[2**63, b"", b"x" * 65, b"absent"])
        assert names(reply["results"]) == ["BAD_REQUEST", "BAD_REQUEST", "KEY_TOO_LONG", "MISS"]


@pytest.mark.parametrize("persistent", [False, True], ids=["nvme", "nvme+cpu-persistent"])
def test_regression_hello_rank_2_63_cannot_poison_the_index(daemon_factory, persistent):
    flags = ("--cpu-persistent",) if persistent else ()
    d = daemon_factory(*flags, cpu_bytes="2MiB", nvme_bytes="64MiB")
    with InlineSession(d.address, namespace="victim") as victim:
        _attack_and_survive(d, victim)


def _attack_and_survive(d, victim) -> None:
    first = {b"v%02d" % i: payload(("first", i), 200_000) for i in range(10)}  # 2x the CPU tier
    assert names(victim.put(first)) == ["OK"] * 10
    raw = RawClient(d.address)
    try:
        for rank in (2**63, 2**64 - 1):
            reply = _hello(raw, namespace="attacker", rank=rank, world_size=4096)
            assert reply["name"] == "BAD_REQUEST", reply
        reply = _hello(raw, namespace="attacker", rank=4095, world_size=4096,  # the real maximum
                       staging=inline_staging(d.address))
        assert reply["name"] == "OK", reply
        attacker_chunk = payload("attacker", 70_000)
        reply, _ = raw.request(Op.PUT, [attacker_chunk], items=[[b"a", 0, len(attacker_chunk)]])
        assert names(reply["results"]) == ["OK"]
    finally:
        raw.close()
    # Every later index write still works, for everyone: more demotions, deletes, promotions.
    second = {b"w%02d" % i: payload(("second", i), 200_000) for i in range(10)}
    assert names(victim.put(second)) == ["OK"] * 10
    assert names(victim.delete([b"v00"])) == ["OK"]
    everything = {**first, **second}
    del everything[b"v00"]
    results, frames, _ = victim.get({k: len(v) for k, v in everything.items()})
    assert names(results) == ["OK"] * len(everything)
    assert frames == list(everything.values())
    assert victim.lookup([b"v00"]) == [Tier.NONE]
    assert "cannot start a transaction" not in d.log()
    d.check()
