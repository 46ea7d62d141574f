"""The wire protocol: frozen op/status numbers, bounded header decoding, one reply envelope."""

import random

import msgpack
import pytest

from kvtierd.protocol import (
    MAX_HANDSHAKE_BYTES,
    MAX_KEY_BYTES,
    PROTOCOL_VERSION,
    SECRET_BYTES,
    RESULTS_AS_BYTES_MIN,
    STAGING_KINDS,
    STORED,
    TICKET_BYTES,
    Op,
    ProtocolError,
    Status,
    Tier,
    pack,
    reply,
    request,
    status_name,
    unpack,
)

# Wire numbers are frozen: a renumbering must fail here, not in a client in production.
OPS = {
    "HELLO": 1, "PING": 2, "LOOKUP": 3, "PUT": 4, "GET": 5, "DELETE": 6, "STATS": 7, "BYE": 8,
    "CHECK": 9,
}  # fmt: skip
STATUSES = {
    "OK": 0, "BAD_MESSAGE": 1, "UNSUPPORTED_VERSION": 2, "UNKNOWN_OP": 3, "NO_SESSION": 4,
    "BAD_REQUEST": 5, "TOO_LARGE": 6, "KEY_TOO_LONG": 7, "OUT_OF_BOUNDS": 8, "BAD_HANDLE": 9,
    "MISS": 10, "NO_SPACE": 11, "LAYOUT_MISMATCH": 12, "SIZE_MISMATCH": 13, "AUTH_FAILED": 14,
    "EXISTS": 15, "BUSY": 16, "INTERNAL": 17, "SHUTTING_DOWN": 18, "CHECKSUM_MISMATCH": 19,
    "QUOTA_EXCEEDED": 20,
}  # fmt: skip
TIERS = {"NONE": 0, "CPU": 1, "NVME": 2}


@pytest.mark.parametrize("enum_cls, expected", [(Op, OPS), (Status, STATUSES), (Tier, TIERS)])
def test_wire_numbers_are_frozen_and_unique(enum_cls, expected):
    assert {name: enum_cls[name].value for name in expected} == expected
    assert len(enum_cls.__members__) == len(enum_cls)  # no aliases (a reused number)
    appended = {m.name: m.value for m in enum_cls if m.name not in expected}
    assert all(v > max(expected.values()) for v in appended.values()), appended  # append only


def test_constants():
    # 2: staging by memfd over the handshake socket (named /dev/shm staging removed)
    assert PROTOCOL_VERSION == 3 and MAX_KEY_BYTES == 64 and SECRET_BYTES == 16
    assert TICKET_BYTES == 16 and MAX_HANDSHAKE_BYTES == 4096
    assert STAGING_KINDS == ("memfd", "cuda_ipc", "inline")
    assert STORED == {Status.OK, Status.EXISTS}


def test_pack_unpack_round_trip():
    rng = random.Random(5)
    keys = [rng.randbytes(rng.randint(1, MAX_KEY_BYTES)) for _ in range(20)]
    items = [[k, rng.randrange(2**40), rng.randrange(2**30)] for k in keys]
    header = request(Op.PUT, 123, items=items, note="héllo", ratio=0.25, flag=True, none=None)
    frame = pack(header)
    decoded = unpack(frame, max_bytes=len(frame))
    assert decoded == header
    assert all(isinstance(item[0], bytes) for item in decoded["items"])  # bin stays bytes
    assert decoded["v"] == PROTOCOL_VERSION and decoded["op"] == 4 and decoded["id"] == 123


def test_reply_envelope():
    assert reply(9, Status.BUSY, "wait", results=[16]) == {
        "v": PROTOCOL_VERSION, "id": 9, "status": 16, "name": "BUSY", "message": "wait", "results": [16]
    }
    ok = unpack(pack(reply(3)), 1024)
    assert (ok["status"], ok["name"], ok["message"]) == (0, "OK", "")


@pytest.mark.parametrize(
    "frame",
    [
        msgpack.packb([1, 2, 3]),
        msgpack.packb("header"),
        msgpack.packb(7),
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # truncated array
        b"",
        msgpack.packb({"v": 1}) + b"\x00",  # trailing bytes
        msgpack.packb({1: 2}),  # non-string map key
    ],
)
def test_unpack_refuses_non_maps_and_garbage(frame):
    with pytest.raises(ProtocolError) as info:
        unpack(frame, 1024)
    assert info.value.status is Status.BAD_MESSAGE and info.value.message


def test_unpack_refuses_oversize_before_decoding():
    frame = pack({"pad": random.Random(1).randbytes(100)})
    assert unpack(frame, len(frame))["pad"]  # exactly at the limit is fine
    with pytest.raises(ProtocolError) as info:
        unpack(frame, len(frame) - 1)
    assert info.value.status is Status.TOO_LARGE
    assert str(len(frame)) in info.value.message and str(len(frame) - 1) in info.value.message
    with pytest.raises(ProtocolError) as info:
        unpack(b"\xc1" * 50, 10)  # garbage over the limit is TOO_LARGE, not BAD_MESSAGE
    assert info.value.status is Status.TOO_LARGE


def test_status_name():
    assert status_name(0) == "OK" and status_name(19) == "CHECKSUM_MISMATCH"
    assert status_name(999) == "UNKNOWN_STATUS_999"


def test_pack_writes_long_status_lists_as_msgpack_does():
    """A reply's long ``results`` list of small ints is packed from its bytes: the same bytes as
    msgpack's own packing, for every length around the threshold and every status value, and
    lists it cannot write that way (a value past 127, negative, not an int) go through packb."""
    rng = random.Random(5)
    lengths = [0, 1, RESULTS_AS_BYTES_MIN - 1, RESULTS_AS_BYTES_MIN, 4096]
    for n in lengths:
        for values in ([0] * n, [rng.randrange(128) for _ in range(n)],
                       [int(rng.choice(list(Status))) for _ in range(n)],
                       [rng.choice(list(Status)) for _ in range(n)]):
            header = reply(7, Status.OK, results=values, errors=[[1, "x"]] if n else [])
            assert pack(header) == msgpack.packb(header, use_bin_type=True)
            assert unpack(pack(header), 1 << 20)["results"] == values
    for odd in (128, 255, 256, -1, "0", None, 1.0, b"\x00"):
        values = [0] * RESULTS_AS_BYTES_MIN + [odd]
        header = reply(7, Status.OK, results=values, errors=[])
        assert pack(header) == msgpack.packb(header, use_bin_type=True)
    # the results key anywhere in the map: the other fields keep their order and bytes
    header = {"results": [1] * 40, "v": 2, "id": b"\xff" * 3, "nested": {"results": [1] * 40}}
    assert pack(header) == msgpack.packb(header, use_bin_type=True)
