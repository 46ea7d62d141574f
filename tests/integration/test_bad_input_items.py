"""Bad input from a client: every case gets a clear answer and hurts nobody else (each case also
checks a bystander session, see tests/helpers/bad_input.py). This file: per-item checks (staging
bounds, keys, namespaces, layouts, sizes, payload frames, inline sessions) and a staging buffer
the client tries to shrink under the daemon.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import pytest
from helpers.bad_input import (
    POISON,
    SENTINEL,
    Session,
    packed,
    bystander,
    item_errors,
    names,
    namespace,
    stop_tolerating_traceback,
)
from helpers.daemon import DaemonProcess
from helpers.raw import RawClient

from kvtierd.protocol import MAX_KEY_BYTES, PROTOCOL_VERSION, Op, Status, Tier

pytestmark = pytest.mark.timeout(60)


# -- memfd staging: bounds -----------------------------------------------------------------------
STAGE = 200_000  # announced staging size: not a multiple of the 4 KiB page, so the daemon's
SLACK = 4096 - STAGE % 4096  # mapping reaches past it to the page end, where a sentinel lies
CHUNK = 8192


def test_get_out_of_bounds_copies_nothing_and_never_past_the_buffer(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(STAGE)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]

        buf.fill(POISON, 0, STAGE)
        buf.fill(SENTINEL, STAGE)
        items = [
            [b"k", -1, CHUNK],
            [b"k", STAGE - CHUNK // 2, CHUNK],  # straddles the end
            [b"k", STAGE, CHUNK],  # starts right at the end
            [b"k", STAGE - CHUNK + 1, CHUNK],  # one byte past the end
            [b"k", 0, 2**62],  # huge nbytes
            [b"k", 2**63 - 1, CHUNK],  # huge offset
            [b"k", 100_000, CHUNK],  # valid: a hit
            [b"k", STAGE - CHUNK, CHUNK],  # valid: ends exactly at the end of the buffer
            [b"k", "0", CHUNK],  # offset not an int
            [b"k", None, CHUNK],
        ]
        reply, payload = s.get(items)
        assert payload == []
        oob = ["OUT_OF_BOUNDS"]
        assert names(reply["results"]) == oob * 6 + ["OK", "OK"] + oob * 2
        errors = item_errors(reply)
        assert sorted(errors) == [0, 1, 2, 3, 4, 5, 8, 9]
        for i in (0, 1, 2, 3, 4, 5):
            name, message = errors[i]
            assert name == "OUT_OF_BOUNDS"
            assert f"[{items[i][1]}, {items[i][1]}+{items[i][2]})" in message, message
            assert f"[0, {STAGE})" in message, message
        assert "'0'" in errors[8][1] and "None" in errors[9][1]

        assert buf.read(100_000, CHUNK) == data
        assert buf.read(STAGE - CHUNK, CHUNK) == data
        expected_poison = [(0, 100_000), (100_000 + CHUNK, STAGE - CHUNK)]
        for start, end in expected_poison:
            assert buf.read(start, end - start) == bytes([POISON]) * (end - start), (start, end)
        assert buf.read(STAGE, SLACK) == bytes([SENTINEL]) * SLACK, "bytes past the buffer written"
        shared.check()


def test_put_out_of_bounds_stores_nothing(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(STAGE, fill=SENTINEL)
        buf.fill(0x11, 0, STAGE)
        s = sessions(shared.address, namespace(), staging=buf)
        before = shared.cpu()
        items = [
            [b"neg", -1, CHUNK],
            [b"straddle", STAGE - CHUNK // 2, CHUNK],
            [b"at-end", STAGE, 1],
            [b"huge", 0, 2**62],
            [b"huge-offset", 2**63 - 1, CHUNK],
            [b"str-offset", "0", CHUNK],
            [b"fits", STAGE - CHUNK, CHUNK],
        ]
        reply = s.put(items)
        assert names(reply["results"]) == ["OUT_OF_BOUNDS"] * 6 + ["OK"]
        errors = item_errors(reply)
        assert f"[0, {STAGE})" in errors[1][1] and f"[{STAGE - CHUNK // 2}, " in errors[1][1]
        assert s.lookup([item[0] for item in items]) == [0] * 6 + [Tier.CPU]
        after = shared.cpu()
        assert after["chunks"] == before["chunks"] + 1
        assert after["pending_chunks"] == 0
        assert after["used_bytes"] == before["used_bytes"] + 64 * 1024
        # the staging file, including the bytes past the announced size, is untouched
        assert buf.read(0, STAGE) == b"\x11" * STAGE
        assert buf.read(STAGE, SLACK) == bytes([SENTINEL]) * SLACK


@pytest.mark.parametrize("nbytes", [0, -1, -CHUNK, 1.5, "8192", None, True])
def test_bad_nbytes_is_a_per_item_bad_request(shared, memfd, sessions, nbytes):
    # nbytes 0 and negative ones are refused by the daemon's nbytes check (BAD_REQUEST) before the
    # staging range check (which would say OUT_OF_BOUNDS); either way nothing is copied.
    with bystander(shared, memfd):
        buf = memfd(STAGE, fill=SENTINEL)
        buf.fill(POISON, 0, STAGE)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        buf.fill(POISON, 0, STAGE)
        reply = s.put([[b"bad", 0, nbytes], [b"good", 0, CHUNK]])
        assert names(reply["results"]) == ["BAD_REQUEST", "OK"]
        name, message = item_errors(reply)[0]
        assert f"nbytes {nbytes!r}" in message and "positive int" in message, message
        reply, _ = s.get([[b"k", 4096, nbytes], [b"k", 20_000, CHUNK]])
        assert names(reply["results"]) == ["BAD_REQUEST", "OK"]
        assert buf.read(20_000, CHUNK) == data
        assert buf.read(0, 20_000) == bytes([POISON]) * 20_000
        assert buf.read(STAGE, SLACK) == bytes([SENTINEL]) * SLACK
        assert s.lookup([b"bad"]) == [0]


# -- keys ------------------------------------------------------------------------------------------
def test_key_length_and_type_are_checked_per_item(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(8 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        key64 = b"\x01" * MAX_KEY_BYTES
        key65 = b"\x02" * (MAX_KEY_BYTES + 1)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        keys: list[Any] = [key64, key65, b"\x03" * 1000, b"", "text-key", 5, None]
        reply = s.put([[k, 0, CHUNK] for k in keys])
        expected = ["OK", "KEY_TOO_LONG", "KEY_TOO_LONG"] + ["BAD_REQUEST"] * 4
        assert names(reply["results"]) == expected
        errors = item_errors(reply)
        assert "65 bytes" in errors[1][1] and f"{MAX_KEY_BYTES}-byte limit" in errors[1][1]
        assert "1000 bytes" in errors[2][1]
        assert errors[3][1] == "key is empty"
        assert "'text-key'" in errors[4][1] and "not bytes" in errors[4][1]
        assert "key 5 " in errors[5][1] and "key None " in errors[6][1]

        buf.fill(POISON)
        reply, _ = s.get([[k, CHUNK * (i + 1), CHUNK] for i, k in enumerate(keys)])
        assert names(reply["results"]) == expected
        assert buf.read(CHUNK, CHUNK) == data, "the 64-byte key did not round-trip"
        assert buf.read(2 * CHUNK, 6 * CHUNK) == bytes([POISON]) * 6 * CHUNK
        assert buf.read(0, CHUNK) == bytes([POISON]) * CHUNK

        # LOOKUP and DELETE check keys too (LOOKUP refuses the whole request)
        assert s.lookup([key64]) == [Tier.CPU]
        reply, _ = s.request(Op.LOOKUP, keys=[key64, key65])
        assert reply["name"] == "KEY_TOO_LONG" and "65 bytes" in reply["message"], reply
        reply, _ = s.request(Op.LOOKUP, keys=[b""])
        assert reply["name"] == "BAD_REQUEST" and "empty" in reply["message"], reply
        for bad in ("text-key", 5, None, [1, 2], {"k": 1}):  # after a good key: the whole batch
            reply, _ = s.request(Op.LOOKUP, keys=[key64, bad])
            assert reply["name"] == "BAD_REQUEST" and "not bytes" in reply["message"], reply
        reply, _ = s.request(Op.DELETE, keys=[key65, b"", "text-key"])
        assert names(reply["results"]) == ["KEY_TOO_LONG", "BAD_REQUEST", "BAD_REQUEST"]
        assert s.lookup([key64]) == [Tier.CPU]


# -- namespaces, layouts, sizes ------------------------------------------------------------------
def test_other_namespace_or_rank_cannot_see_a_chunk(shared, memfd, sessions):
    with bystander(shared, memfd):
        ns = namespace()
        buf = memfd(4 * CHUNK)
        owner = sessions(shared.address, ns, staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(owner.put([[b"secret", 0, CHUNK]])["results"]) == ["OK"]
        for other_ns, rank in ((namespace(), 0), (ns, 1)):
            obuf = memfd(4 * CHUNK, fill=POISON)
            other = sessions(shared.address, other_ns, staging=obuf, rank=rank)
            assert other.lookup([b"secret"]) == [0]
            reply, _ = other.get([[b"secret", 0, CHUNK]])
            assert names(reply["results"]) == ["MISS"]
            assert obuf.read(0, 4 * CHUNK) == bytes([POISON]) * 4 * CHUNK
            reply, _ = other.request(Op.DELETE, keys=[b"secret"])
            assert names(reply["results"]) == ["MISS"]
        buf.fill(POISON)
        reply, _ = owner.get([[b"secret", CHUNK, CHUNK]])
        assert names(reply["results"]) == ["OK"] and buf.read(CHUNK, CHUNK) == data


def test_put_with_other_layout_fingerprint_keeps_the_stored_chunk(shared, memfd, sessions):
    with bystander(shared, memfd):
        ns = namespace()
        buf_a = memfd(4 * CHUNK)
        a = sessions(shared.address, ns, staging=buf_a, fingerprint="fp-a")
        data = os.urandom(CHUNK)
        buf_a.write(0, data)
        assert names(a.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        commits = shared.cpu()["commits"]

        buf_b = memfd(4 * CHUNK)
        b = sessions(shared.address, ns, staging=buf_b, fingerprint="fp-b")
        buf_b.write(0, os.urandom(CHUNK))
        reply = b.put([[b"k", 0, CHUNK]])
        assert names(reply["results"]) == ["LAYOUT_MISMATCH"]
        assert "fingerprint" in item_errors(reply)[0][1]
        assert shared.cpu()["commits"] == commits

        before_b = buf_b.read(0, 4 * CHUNK)
        reply, _ = b.get([[b"k", 0, CHUNK]])
        assert names(reply["results"]) == ["LAYOUT_MISMATCH"]  # a miss, with the reason
        assert buf_b.read(0, 4 * CHUNK) == before_b
        assert b.lookup([b"k"]) == [0]
        reply, _ = b.request(Op.DELETE, keys=[b"k"])
        assert names(reply["results"]) == ["LAYOUT_MISMATCH"]

        buf_a.fill(POISON)
        reply, _ = a.get([[b"k", CHUNK, CHUNK]])
        assert names(reply["results"]) == ["OK"]
        assert buf_a.read(CHUNK, CHUNK) == data
        assert a.lookup([b"k"]) == [Tier.CPU]


def test_get_with_wrong_nbytes_is_size_mismatch(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(8 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(5000)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, 5000]])["results"]) == ["OK"]
        buf.fill(POISON)
        reply, _ = s.get([[b"k", 0, 4096], [b"k", CHUNK, 5001], [b"k", 2 * CHUNK, CHUNK],
                          [b"k", 3 * CHUNK, 5000]])
        assert names(reply["results"]) == ["SIZE_MISMATCH"] * 3 + ["OK"]
        assert buf.read(0, 3 * CHUNK) == bytes([POISON]) * 3 * CHUNK
        assert buf.read(3 * CHUNK, 5000) == data
        # a PUT of the same key with another size is refused, the stored chunk kept
        buf.write(0, os.urandom(CHUNK))
        reply = s.put([[b"k", 0, CHUNK]])
        assert names(reply["results"]) == ["SIZE_MISMATCH"]
        assert "another size" in item_errors(reply)[0][1]
        buf.fill(POISON)
        reply, _ = s.get([[b"k", 100, 5000]])
        assert names(reply["results"]) == ["OK"] and buf.read(100, 5000) == data


def test_re_put_is_exists_and_copies_nothing(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(4 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        before = shared.cpu()
        buf.write(0, os.urandom(CHUNK))  # other bytes under the same key
        reply = s.put([[b"k", 0, CHUNK], [b"k", CHUNK, CHUNK]])
        assert names(reply["results"]) == ["EXISTS", "EXISTS"]
        assert reply["errors"] == []  # a successful no-op has no message
        after = shared.cpu()
        assert after["commits"] == before["commits"]
        assert after["used_bytes"] == before["used_bytes"]
        buf.fill(POISON)
        reply, _ = s.get([[b"k", 2 * CHUNK, CHUNK]])
        assert names(reply["results"]) == ["OK"] and buf.read(2 * CHUNK, CHUNK) == data


# -- unexpected payload frames ----------------------------------------------------------------
def test_put_with_payload_frames_on_shm_session_is_bad_request(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(4 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        buf.write(0, os.urandom(CHUNK))
        reply, payload = s.request(Op.PUT, [b"x" * CHUNK], items=[[b"k", 0, CHUNK]])
        assert reply["name"] == "BAD_REQUEST", reply
        assert "payload frames" in reply["message"] and "inline" in reply["message"]
        assert payload == []
        assert s.lookup([b"k"]) == [0]
        assert shared.cpu()["pending_chunks"] == 0
        # the session is still usable
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]


def test_get_with_payload_frames_on_memfd_session_is_bad_request(shared, memfd, sessions):
    with bystander(shared, memfd):
        buf = memfd(4 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        buf.write(0, os.urandom(CHUNK))
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        buf.fill(POISON)
        reply, payload = s.request(Op.GET, [b"x" * CHUNK], items=[[b"k", 0, CHUNK]])
        assert reply["name"] == "BAD_REQUEST", reply
        assert "payload frames" in reply["message"], reply
        assert buf.read(0, 4 * CHUNK) == bytes([POISON]) * 4 * CHUNK


# -- inline sessions -------------------------------------------------------------------------------
def test_inline_put_frame_count_and_sizes_are_checked(shared, memfd, sessions):
    with bystander(shared, memfd):
        s = sessions(shared.address, namespace())
        reply, _ = s.request(Op.PUT, [], items=[[b"k", 0, 10]])
        assert reply["name"] == "BAD_REQUEST"
        assert "1 items, 0 frames" in reply["message"], reply
        reply, _ = s.request(Op.PUT, [b"a" * 10, b"b" * 10], items=[[b"k", 0, 10]])
        assert reply["name"] == "BAD_REQUEST" and "1 items, 2 frames" in reply["message"]
        reply = s.put([[b"short", 0, 10], [b"long", 0, 10], [b"ok", 0, 10]],
                      [b"x" * 9, b"x" * 11, b"x" * 10])
        assert names(reply["results"]) == ["SIZE_MISMATCH", "SIZE_MISMATCH", "OK"]
        errors = item_errors(reply)
        assert "9 bytes" in errors[0][1] and "says 10" in errors[0][1]
        assert "11 bytes" in errors[1][1]
        assert s.lookup([b"k", b"short", b"long", b"ok"]) == [0, 0, 0, Tier.CPU]
        assert shared.cpu()["pending_chunks"] == 0


def test_inline_get_returns_one_frame_per_item(shared, memfd, sessions):
    with bystander(shared, memfd):
        s = sessions(shared.address, namespace())
        a, b = os.urandom(1000), os.urandom(CHUNK)
        assert names(s.put([[b"a", 0, 1000], [b"b", 0, CHUNK]], [a, b])["results"]) == ["OK"] * 2
        reply, payload = s.get([[b"a", 0, 1000], [b"missing", 0, 10], [b"b", 0, CHUNK]])
        assert names(reply["results"]) == ["OK", "MISS", "OK"]
        assert payload == [a, b"", b], [len(p) for p in payload]


# -- a staging buffer that a client tries to shrink under the daemon ------------------------------------------------
def _reply_or_death(raw: RawClient, d: DaemonProcess, timeout_s: float = 10.0) -> dict | None:
    """The next non-probe reply, or None as soon as the daemon process is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if raw.sock.poll(50):
            header = msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False)
            if header.get("id") != 0:
                return header
        elif not d.alive():
            return None
    raise AssertionError("no reply, and the daemon is still alive")


@pytest.mark.parametrize("op", [Op.PUT, Op.GET], ids=lambda o: o.name)
def test_staging_file_truncated_after_hello_does_not_kill_the_daemon(daemon_factory, memfd, op):
    # Protocol 1 named /dev/shm files could be truncated under the daemon (SIGBUS); a sealed memfd
    # refuses the truncation itself, and the daemon keeps serving from the same buffer.
    d = daemon_factory()
    try:
        with bystander(d, memfd):
            buf = memfd(1 << 20)
            s = Session(d.address, namespace(), staging=buf)
            try:
                data = os.urandom(CHUNK)
                buf.write(0, data)
                assert names(s.put([[b"first", 0, CHUNK]])["results"]) == ["OK"]
                with pytest.raises(PermissionError):
                    os.ftruncate(buf.fd, 0)
                assert os.fstat(buf.fd).st_size == 1 << 20
                key = b"second" if op is Op.PUT else b"first"
                buf.fill(POISON, 512 * 1024, 512 * 1024 + CHUNK) if op is Op.GET else None
                s.raw.send_frames([packed({"v": PROTOCOL_VERSION, "op": int(op), "id": 50,
                                            "secret": s.raw.secret, "items": [[key, 512 * 1024 if op is Op.GET else 0,
                                                       CHUNK]]})])
                reply = _reply_or_death(s.raw, d)
                assert reply is not None, f"the daemon died ({d.proc.returncode})"
                assert reply["id"] == 50 and reply["results"] == [Status.OK], reply
                if op is Op.GET:
                    assert buf.read(512 * 1024, CHUNK) == data
            finally:
                s.close()
    finally:
        stop_tolerating_traceback(d)
