"""Bad input from a client: every case gets a clear answer and hurts nobody else (each case also
checks a bystander session, see tests/helpers/bad_input.py). This file: the message envelope,
HELLO and its staging maps (tickets), auth.
"""

from __future__ import annotations

import random
import secrets
from typing import Any

import pytest
from helpers.bad_input import (
    packed,
    bystander,
    namespace,
    send_raw,
    stop_tolerating_traceback,
    write_toml,
)
from helpers.daemon import DaemonProcess
from helpers.handshake import inline_staging, ticket
from helpers.raw import RawClient

from kvtierd.protocol import PROTOCOL_VERSION, Op, Status

pytestmark = pytest.mark.timeout(60)


MALFORMED = {
    # name: (frame, reply id, fragment of the message)
    "random-bytes-1": (random.Random(1).randbytes(64), None, "not valid msgpack"),
    "random-bytes-2": (random.Random(2).randbytes(300), None, "not valid msgpack"),
    "reserved-byte": (b"\xc1", None, "not valid msgpack"),
    "truncated-map": (packed({"v": PROTOCOL_VERSION, "op": 2, "id": 5})[:-1], None,
                      "not valid msgpack"),
    "huge-array-length": (b"\xdd\xff\xff\xff\xff", None, "not valid msgpack"),
    "trailing-garbage": (packed({"v": PROTOCOL_VERSION, "op": 2, "id": 5}) + b"\x00", None,
                         "not valid msgpack"),
    "list-not-map": (packed([1, 2, 5]), None, "must be a msgpack map, got list"),
    "int-not-map": (packed(7), None, "must be a msgpack map, got int"),
    "int-map-keys": (packed({1: 1, 2: 2}), None, "not valid msgpack"),
    "missing-id": (packed({"v": PROTOCOL_VERSION, "op": int(Op.PING)}), None,
                   "request id None is not an int"),
    "id-is-str": (packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": "7"}), "7",
                  "request id '7' is not an int"),
    "id-is-float": (packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 1.5}), 1.5,
                    "request id 1.5 is not an int"),
    "id-is-bool": (packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": True}), True,
                   "request id True is not an int"),
    "id-is-list": (packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": [1]}), [1],
                   "request id [1] is not an int"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header_is_bad_message(shared, memfd, case):
    frame, reply_id, fragment = MALFORMED[case]
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            reply = send_raw(raw, [frame])
            assert reply["name"] == "BAD_MESSAGE" and reply["status"] == Status.BAD_MESSAGE
            assert reply["id"] == reply_id, reply
            assert fragment in reply["message"], reply
            assert reply["v"] == PROTOCOL_VERSION
            # the same peer is still served
            assert raw.request(Op.PING)[0]["name"] == "OK"
        finally:
            raw.close()


@pytest.mark.parametrize("op", [99, 0, -1, "PUT", 2**40])
def test_unknown_op(shared, memfd, op):
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            reply = send_raw(raw, [packed({"v": PROTOCOL_VERSION, "op": op, "id": 12})])
            assert reply["name"] == "UNKNOWN_OP" and reply["id"] == 12, reply
            assert f"op {op!r} is unknown" in reply["message"], reply
            assert "1 (HELLO)" in reply["message"] and "9 (CHECK)" in reply["message"]
        finally:
            raw.close()


@pytest.mark.parametrize("version", [1, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 0,
                                     str(PROTOCOL_VERSION), float(PROTOCOL_VERSION), True, None,
                                     "missing"])
def test_unsupported_protocol_version(shared, memfd, version):
    header = {"op": int(Op.PING), "id": 41}
    if version != "missing":
        header["v"] = version
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            reply = send_raw(raw, [packed(header)])
            assert reply["name"] == "UNSUPPORTED_VERSION", reply
            assert reply["id"] == 41
            shown = None if version == "missing" else version
            assert f"protocol version {shown!r} is not supported" in reply["message"], reply
            assert f"this daemon speaks {PROTOCOL_VERSION}" in reply["message"], reply
        finally:
            raw.close()


@pytest.mark.parametrize("op,fields", [
    (Op.LOOKUP, {"keys": [b"k"]}),
    (Op.PUT, {"items": [[b"k", 0, 4096]]}),
    (Op.GET, {"items": [[b"k", 0, 4096]]}),
    (Op.DELETE, {"keys": [b"bystander-chunk"]}),
    (Op.BYE, {}),
], ids=["LOOKUP", "PUT", "GET", "DELETE", "BYE"])
def test_ops_before_hello_need_a_session(shared, memfd, op, fields):
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            frames = [b"x" * 4096] if op is Op.PUT else None
            reply, payload = raw.request(op, frames, **fields)
            assert reply["name"] == "NO_SESSION", reply
            assert op.name in reply["message"] and "HELLO" in reply["message"], reply
            assert payload == []
            # ops that need no session still work for the same peer
            assert raw.request(Op.PING)[0]["name"] == "OK"
            assert raw.request(Op.STATS)[0]["name"] == "OK"
        finally:
            raw.close()


# -- HELLO -----------------------------------------------------------------------------------------
def _hello_fields(**overrides: Any) -> dict:
    fields = {"namespace": namespace(), "rank": 0, "world_size": 1, "fingerprint": "fp-a",
              "staging": {"kind": "inline"}}
    for key, value in overrides.items():
        if value is _DROP:
            fields.pop(key)
        else:
            fields[key] = value
    return fields


_DROP = object()


def _assert_no_session(raw: RawClient) -> None:
    reply, _ = raw.request(Op.LOOKUP, keys=[b"k"])
    assert reply["name"] == "NO_SESSION", reply


HELLO_BAD_FIELDS = {
    # name: (overrides, fragments of the message)
    "rank-str": ({"rank": "0"}, ["'rank'", "'0'"]),
    "rank-negative": ({"rank": -1}, ["'rank' is -1", "0..0"]),
    # The attack: rank = 2**63 reached SQLite and poisoned the NVMe index connection.
    "rank-2**63": ({"rank": 2**63, "world_size": 4096}, ["'rank'", str(2**63), "0..4095"]),
    "rank-2**64-1": ({"rank": 2**64 - 1}, ["'rank'", str(2**64 - 1)]),
    "rank-equals-world-size": ({"rank": 4, "world_size": 4}, ["'rank' is 4", "0..3"]),
    "world-size-0": ({"world_size": 0}, ["'world_size' is 0", "1..4096"]),
    "world-size-4097": ({"world_size": 4097}, ["'world_size' is 4097", "1..4096"]),
    "world-size-negative": ({"world_size": -1}, ["'world_size' is -1", "1..4096"]),
    "world-size-missing": ({"world_size": _DROP}, ["'world_size'", "missing"]),
    "world-size-bool": ({"world_size": True}, ["'world_size'", "True"]),
    "world-size-str": ({"world_size": "2"}, ["'world_size'", "'2'"]),
    "fingerprint-long": ({"fingerprint": "f" * 129}, ["fingerprint", "129", "1..128"]),
    "fingerprint-huge": ({"fingerprint": "f" * 500_000}, ["fingerprint", "1..128"]),
    "namespace-huge": ({"namespace": "n" * 500_000}, ["namespace", "1..256"]),
    "client-not-map": ({"client": [1, 2]}, ["'client'", "a map"]),
    "client-deep": ({"client": {"a": {"b": {"c": 1}}}}, ["'client'", "deeper than 2"]),
    "client-many": ({"client": {f"k{i}": i for i in range(33)}}, ["'client'", "32 entries"]),
    "client-many-nested": ({"client": {"a": list(range(40))}}, ["'client'", "32 entries"]),
    "client-long-string": ({"client": {"lib": "x" * 257}}, ["'client'", "257", "<= 256"]),
    "client-long-key": ({"client": {"k" * 300: 1}}, ["'client'", "key"]),
    "client-huge-int": ({"client": {"pid": 2**64 - 1}}, ["'client'", "64 bits"]),
    "rank-bool": ({"rank": True}, ["'rank'", "True"]),
    "rank-float": ({"rank": 0.0}, ["'rank'", "0.0"]),
    "rank-missing": ({"rank": _DROP}, ["'rank'", "missing"]),
    "namespace-empty": ({"namespace": ""}, ["namespace", "1..256"]),
    "namespace-long": ({"namespace": "n" * 257}, ["namespace", "1..256"]),
    "namespace-int": ({"namespace": 5}, ["'namespace'", "5"]),
    "namespace-bytes": ({"namespace": b"ns"}, ["'namespace'", "b'ns'"]),
    "namespace-missing": ({"namespace": _DROP}, ["'namespace'", "missing"]),
    "fingerprint-empty": ({"fingerprint": ""}, ["fingerprint", "1..128"]),
    "fingerprint-int": ({"fingerprint": 3}, ["'fingerprint'", "3"]),
    "staging-str": ({"staging": "memfd"}, ["'staging'", "'memfd'"]),
    "staging-missing": ({"staging": _DROP}, ["'staging'", "missing"]),
}


@pytest.mark.parametrize("case", sorted(HELLO_BAD_FIELDS))
def test_hello_with_wrong_field_is_bad_request(shared, memfd, case):
    overrides, fragments = HELLO_BAD_FIELDS[case]
    with bystander(shared, memfd):
        sessions_before = shared.stats()["sessions"]
        raw = RawClient(shared.address)
        try:
            reply, _ = raw.request(Op.HELLO, **_hello_fields(**overrides))
            assert reply["name"] == "BAD_REQUEST", reply
            for fragment in fragments:
                assert fragment in reply["message"], (fragment, reply)
            _assert_no_session(raw)
            assert shared.stats()["sessions"] <= sessions_before
        finally:
            raw.close()


def _staging_case(case: str, shared: DaemonProcess, memfd):
    """(staging spec, message fragments) for one bad HELLO staging map (the handshake's own
    refusals are in test_staging_handshake.py)."""
    cuda = {"handle": b"\x00" * 64, "nbytes": 4096, "device": 0}
    if case == "shm-by-name":  # protocol 1's named /dev/shm staging
        return {"kind": "shm", "name": "kvtier-stg-x", "nbytes": 4096}, [
            "shm staging by name was removed in protocol 2", "handshake (memfd)"]
    if case == "memfd-no-ticket":
        return {"kind": "memfd"}, ["staging ticket None", "16 bytes"]
    if case == "memfd-ticket-short":
        return {"kind": "memfd", "ticket": b"t" * 15}, ["staging ticket b'ttt", "16 bytes"]
    if case == "memfd-ticket-str":
        return {"kind": "memfd", "ticket": "t" * 16}, ["staging ticket 'ttt", "16 bytes"]
    if case == "memfd-ticket-unknown":
        return {"kind": "memfd", "ticket": secrets.token_bytes(16)}, ["ticket is unknown"]
    if case == "memfd-ticket-of-inline":
        return {"kind": "memfd", "ticket": ticket(shared.address, "inline")}, [
            "issued for kind 'inline'", "'memfd'"]
    if case == "inline-ticket-unknown":
        return {"kind": "inline", "ticket": secrets.token_bytes(16)}, ["ticket is unknown"]
    if case == "inline-ticket-of-memfd":
        buf = memfd(4096)
        return {"kind": "inline", "ticket": buf.hello_staging(shared.address)["ticket"]}, [
            "issued for kind 'memfd'", "'inline'"]
    if case == "cuda-ipc-no-ticket":
        return {"kind": "cuda_ipc", **cuda}, ["staging ticket None"]
    if case == "cuda-ipc-nbytes-differs":
        spec = {"kind": "cuda_ipc", "ticket": ticket(shared.address, "cuda_ipc", 8192), **cuda}
        return spec, ["cuda_ipc nbytes 4096", "8192 of its handshake"]
    if case == "unknown-kind":
        return {"kind": "tcp"}, ["staging kind 'tcp' is unknown", "memfd", "inline"]
    if case == "kind-missing":
        return {"name": "kvtier-stg-x", "nbytes": 1}, ["staging kind None is unknown"]
    if case == "cuda-ipc":
        spec = {"kind": "cuda_ipc", "ticket": ticket(shared.address, "cuda_ipc", 4096), **cuda}
        return spec, ["CUDA", "memfd"]
    raise AssertionError(case)


STAGING_CASES = [
    "shm-by-name", "memfd-no-ticket", "memfd-ticket-short", "memfd-ticket-str",
    "memfd-ticket-unknown", "memfd-ticket-of-inline", "inline-ticket-unknown",
    "inline-ticket-of-memfd", "cuda-ipc-no-ticket", "cuda-ipc-nbytes-differs", "unknown-kind",
    "kind-missing", "cuda-ipc",
]


@pytest.mark.parametrize("case", STAGING_CASES)
def test_hello_with_bad_staging_handle(shared, memfd, case):
    with bystander(shared, memfd):
        tickets_before = shared.stats()["handshake"]["tickets"]
        spec, fragments = _staging_case(case, shared, memfd)
        sessions_before = shared.stats()["sessions"]
        raw = RawClient(shared.address)
        try:
            reply, _ = raw.request(Op.HELLO, **_hello_fields(staging=spec))
            assert reply["name"] == "BAD_HANDLE", reply
            for fragment in fragments:
                assert fragment in reply["message"], (fragment, reply)
            _assert_no_session(raw)
            assert shared.stats()["sessions"] <= sessions_before
            assert shared.stats()["handshake"]["tickets"] <= tickets_before, "a ticket was left"
        finally:
            raw.close()


# -- auth ------------------------------------------------------------------------------------------
def test_auth_token_is_required(daemon_factory, tmp_path, memfd):
    config = write_toml(tmp_path / "auth.toml", 'auth_token = "s3cret"\n')
    d = daemon_factory("--config", str(config))
    with bystander(d, memfd, token="s3cret"):
        raw = RawClient(d.address)
        try:
            for token in (_DROP, "wrong", "", "s3cret ", "S3CRET", b"s3cret", 5, None):
                fields = _hello_fields() if token is _DROP else _hello_fields(token=token)
                reply, _ = raw.request(Op.HELLO, **fields)
                assert reply["name"] == "AUTH_FAILED", (token, reply)
                assert "token" in reply["message"] and "s3cret" not in reply["message"]
                _assert_no_session(raw)
            reply, _ = raw.request(Op.HELLO, **_hello_fields(token="s3cret"))
            assert reply["name"] == "AUTH_FAILED", reply  # auth_token alone names no tenant
            assert "anonymous_tenant" in reply["message"], reply
            reply, _ = raw.request(Op.HELLO, **_hello_fields(
                token="s3cret", staging=inline_staging(d.address)))
            assert reply["name"] == "OK", reply
            assert raw.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "OK"
        finally:
            raw.close()


def test_non_ascii_auth_token_is_auth_failed(daemon_factory, tmp_path, memfd):
    config = write_toml(tmp_path / "auth.toml", 'auth_token = "s3cret"\n')
    d = daemon_factory("--config", str(config))
    try:
        with bystander(d, memfd, token="s3cret"):
            raw = RawClient(d.address)
            try:
                reply, _ = raw.request(Op.HELLO, **_hello_fields(token="sécret"))
                assert reply["name"] == "AUTH_FAILED", reply
                _assert_no_session(raw)
            finally:
                raw.close()
        assert "Traceback" not in d.log()
    finally:
        stop_tolerating_traceback(d)
