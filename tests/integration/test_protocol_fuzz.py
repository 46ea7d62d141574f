"""Protocol fuzzer: generated frame lists against one real daemon (hypothesis, derandomized).

Frames are garbage bytes, random msgpack values, and well-formed envelopes with random ops and
random-typed fields (huge and negative ints, nested maps, wrong types, payload frames), sent from
a few peers so that some have sessions. Every message must get exactly one reply with its id, none
INTERNAL (per request or per item); a control session's chunks are byte-exact every
``CONTROL_EVERY`` messages and at the end; at the end the daemon is alive, its INTERNAL counter is
0 and CHECK is clean. Bounded by ``max_examples`` and a wall budget (~60 s on two cores).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import msgpack
import pytest
from helpers.bad_input import LIMITS_TOML, Session, names, namespace, start_daemon, write_toml
from helpers.daemon import DaemonProcess
from helpers.metrics import sample
from helpers.raw import RawClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtierd.protocol import PROTOCOL_VERSION, Op, Status

pytestmark = pytest.mark.timeout(240)

WALL_BUDGET_S = 50.0
PEERS = 3
CONTROL_EVERY = 200  # messages between two reads of the control session's chunks
INT_EDGES = [0, 1, -1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]

ints = st.one_of(st.sampled_from(INT_EDGES), st.integers(-(2**63), 2**64 - 1))
small = st.one_of(st.integers(0, 70_000), ints)  # offsets and sizes: mostly plausible
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True),
                    st.text(max_size=12), st.binary(max_size=80))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
# a few keys and namespaces, so that PUTs, GETs, LOOKUPs and DELETEs meet each other's chunks
keys = st.one_of(st.sampled_from([b"k1", b"k2", b"k3", b"x" * 64]), st.binary(max_size=70),
                 values)
items = st.lists(st.one_of(st.tuples(keys, small, small).map(list), values), max_size=12)
staging = st.one_of(
    st.just({"kind": "inline"}), st.just({"kind": "inline"}),
    st.fixed_dictionaries({"kind": st.sampled_from(["shm", "cuda_ipc", "memfd", "inline", 7])},
                          optional={"ticket": st.one_of(st.binary(min_size=16, max_size=16),
                                                        values),
                                    "name": values, "nbytes": ints,
                                    "handle": st.binary(max_size=70),
                                    "device": ints, "pci_bus_id": values}),
    values)
def mostly(right: st.SearchStrategy, wrong: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(right, right, right, wrong)


FIELDS = {
    Op.HELLO: {"namespace": mostly(st.sampled_from(["fz-a", "fz-b"]), values),
               "rank": mostly(st.integers(0, 3), st.one_of(ints, values)),
               "world_size": mostly(st.just(4), st.one_of(ints, values)),
               "fingerprint": mostly(st.sampled_from(["fp-fuzz", "fp-other"]), values),
               "staging": mostly(st.just({"kind": "inline"}), staging), "token": values,
               "client": values},
    Op.LOOKUP: {"keys": mostly(st.lists(keys, max_size=20), values), "lease": values},
    Op.PUT: {"items": mostly(items, values)},
    Op.GET: {"items": mostly(items, values)},
    Op.DELETE: {"keys": mostly(st.lists(keys, max_size=20), values)},
    Op.STATS: {"token": values}, Op.CHECK: {"token": values},
    Op.PING: {}, Op.BYE: {},
}
ANY_FIELD = {name: strategy for fields in FIELDS.values() for name, strategy in fields.items()}


def _envelope(op: Op) -> st.SearchStrategy[dict]:
    """A well-formed envelope for ``op``: its fields present and mostly right; extras optional."""
    required = {name: strategy for name, strategy in FIELDS[op].items()
                if name not in ("token", "client", "lease")}
    optional = {name: strategy for name, strategy in FIELDS[op].items() if name not in required}
    return st.fixed_dictionaries(
        {"v": st.just(PROTOCOL_VERSION), "op": st.just(int(op)), "id": st.integers(1, 2**40),
         **required}, optional={**optional, "pad": values})


well_formed = st.sampled_from(list(Op)).flatmap(_envelope)
anything = st.fixed_dictionaries(
    {"v": st.one_of(st.just(PROTOCOL_VERSION), values), "op": st.one_of(ints, values),
     "id": st.one_of(st.integers(1, 2**40), values)}, optional=ANY_FIELD)
packed = lambda strategy: strategy.map(lambda v: msgpack.packb(v, use_bin_type=True))  # noqa: E731
good_hello = st.fixed_dictionaries(  # so that most peers have a session most of the time
    {"v": st.just(PROTOCOL_VERSION), "op": st.just(int(Op.HELLO)), "id": st.integers(1, 2**40),
     "namespace": st.sampled_from(["fz-a", "fz-b"]), "rank": st.integers(0, 3), "world_size": st.just(4),
     "fingerprint": st.sampled_from(["fp-fuzz", "fp-other"]),
     "staging": st.just({"kind": "inline"})})
header = st.one_of(packed(good_hello), packed(well_formed), packed(well_formed),
                   packed(well_formed), packed(anything), packed(values), st.binary(max_size=64))
payload = st.lists(st.one_of(st.binary(min_size=1, max_size=3000).map(lambda b: b * 3),
                             st.binary(max_size=8)), max_size=12)
peer = st.integers(0, PEERS - 1)


@st.composite
def good_put(draw: st.DrawFn) -> tuple[int, bytes, list[bytes]]:
    """An inline PUT whose items and payload frames agree (sizes sometimes off by a little)."""
    chunks = draw(st.lists(st.tuples(keys, st.binary(min_size=1, max_size=2000),
                                     st.sampled_from([0, 0, 0, 1, -1])), min_size=1, max_size=6))
    items = [[key, draw(small), len(data) + delta] for key, data, delta in chunks]
    head = {"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": draw(st.integers(1, 2**40)),
            "items": items}
    return draw(peer), msgpack.packb(head, use_bin_type=True), [data for _, data, _ in chunks]


other = st.tuples(peer, header, st.one_of(st.just([]), st.just([]), payload))
# and whether the peer's session secret (protocol 3) goes into a header that has none: mostly,
# so that sessions are used, sometimes not, so that a session's requests without it are tried
frames = st.tuples(st.one_of(good_put(), other, other, other),
                   st.sampled_from([True, True, True, False]))


def _with_secret(header: bytes, secret: bytes | None) -> bytes:
    """``header`` with ``secret`` added when it is a map without one (else as it is)."""
    if secret is None:
        return header
    try:
        decoded = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except Exception:
        return header
    if not isinstance(decoded, dict) or "secret" in decoded:
        return header
    return msgpack.packb({**decoded, "secret": secret}, use_bin_type=True)


def _opened(header: bytes, reply: dict) -> bytes | None:
    """The secret of the session ``reply`` opened, if ``header`` was a HELLO answered OK."""
    try:
        decoded = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except Exception:
        return None
    if isinstance(decoded, dict) and decoded.get("op") == Op.HELLO and reply.get("status") == 0:
        return reply.get("secret")
    return None


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    # small limits; the control session stays quiet for the whole run; every commit also goes to
    # the NVMe tier and its SQLite index (write-through), so that fuzzed fields reach them too
    config = write_toml(root / "limits.toml", LIMITS_TOML + "session_timeout_s = 600\n")
    d = start_daemon(root, "fuzzed", "--config", str(config), "--nvme-write-policy",
                     "write-through")
    yield d
    d.stop_and_verify()
    d.remove_nvme_data()


def _expected_id(header_frame: bytes) -> Any:
    """The id the reply must echo, or ``...`` when the header cannot be decoded as a map."""
    try:
        header = msgpack.unpackb(header_frame, raw=False, strict_map_key=True)
    except Exception:
        return ...
    return header.get("id") if isinstance(header, dict) else ...


def _is_probe(header: dict) -> bool:
    return header.get("notice") == "probe" and header.get("id") == 0


def _recv_reply(raw: RawClient) -> dict:
    """The next reply that is not a probe notice (a request's own id may be 0 or False)."""
    while True:
        assert raw.sock.poll(10_000), "no reply from the daemon"
        header = msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False)
        if not _is_probe(header):
            return header


def _same(a: Any, b: Any) -> bool:
    pack = lambda x: msgpack.packb(x, use_bin_type=True)  # noqa: E731 (NaN != NaN, tuples)
    return pack(a) == pack(b)


def test_protocol_fuzz_every_frame_answered_nothing_internal(target):
    control = Session(target.address, namespace())
    chunks = {b"control-%d" % i: os.urandom(1000 + 20_000 * i) for i in range(3)}
    for key, data in chunks.items():
        assert names(control.put([[key, 0, len(data)]], [data])["results"]) == ["OK"]
    peers = [RawClient(target.address, timeout_s=10.0) for _ in range(PEERS)]
    secrets_of: list[bytes | None] = [None] * PEERS  # each peer's session secret, once it has one
    deadline = time.monotonic() + WALL_BUDGET_S
    seen = {"sent": 0, "served": 0}

    @settings(max_examples=3000, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames)
    def one_message(case: tuple[tuple[int, bytes, list[bytes]], bool]) -> None:
        if time.monotonic() > deadline:
            return
        (peer, header, payload), with_secret = case
        raw = peers[peer]
        if with_secret:
            header = _with_secret(header, secrets_of[peer])
        raw.send_frames([header, *payload])
        seen["sent"] += 1
        reply = _recv_reply(raw)
        opened = _opened(header, reply)
        if opened is not None:
            secrets_of[peer] = opened
        if reply.get("status") == 0 and "results" in reply:
            seen["served"] += 1  # a PUT, GET or DELETE that reached its session's items
        assert reply["status"] != Status.INTERNAL, (header, reply)
        assert Status.INTERNAL not in reply.get("results", []), (header, reply)
        expected = _expected_id(header)
        if expected is not ...:
            assert _same(reply["id"], expected), (header, reply)
        while raw.sock.poll(0):  # anything else queued now is a probe notice, not a 2nd reply
            extra = msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False)
            assert _is_probe(extra), ("two replies to one message", header, reply, extra)
        if seen["sent"] % CONTROL_EVERY == 0:
            check_control()

    def check_control() -> None:
        """The control session's chunks, byte-exact. Read every CONTROL_EVERY messages, they are
        also the most recently used: the fuzzer's own chunks (about one commit per 20 messages)
        fill the tiers in a long or fast run, and evict only those."""
        for key, data in chunks.items():
            reply, payload = control.get([[key, 0, len(data)]])
            assert names(reply["results"]) == ["OK"] and payload == [data], (key, seen)

    try:
        one_message()
        assert seen["sent"] > 200 and seen["served"] > 20, seen
        assert target.alive(), target.log()
        url = target.stats()["daemon"]["metrics"]
        internal = sum(sample(url, "kvtierd_requests_total", op=op.name.lower(),
                              status="INTERNAL") for op in Op)
        internal += sample(url, "kvtierd_requests_total", op="invalid", status="INTERNAL")
        assert internal == 0, target.log()
        check_control()
        target.check()
        assert "Traceback" not in target.log(), target.log()
    finally:
        for raw in peers:
            raw.close()
        control.close()
