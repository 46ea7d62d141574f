"""Bad input from a client: every case gets a clear answer and hurts nobody else (each case also
checks a bystander session, see tests/helpers/bad_input.py). This file: documented limits, on a
daemon started with small ones.
"""

from __future__ import annotations

import os

import pytest
from helpers.bad_input import Session, packed, bystander, item_errors, names, namespace, send_raw
from helpers.raw import RawClient

from kvtierd.protocol import PROTOCOL_VERSION, Op, Tier

pytestmark = pytest.mark.timeout(60)


# -- limits (a daemon with small ones) -------------------------------------------------------------
def test_oversize_header_frame_is_too_large(limited, memfd):
    with bystander(limited, memfd):
        raw = RawClient(limited.address)
        try:
            header = packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 9,
                         "pad": "x" * 5000})
            reply = send_raw(raw, [header])
            assert reply["name"] == "TOO_LARGE", reply
            assert f"header frame is {len(header)} bytes" in reply["message"], reply
            assert "the limit is 4096" in reply["message"]
            assert reply["id"] is None  # not decoded, so the id is unknown
            # a PUT from a session: refused as a whole, nothing stored
            s = Session(limited.address, namespace())
            try:
                items = [[b"k%d" % i, 0, 1] for i in range(4)]
                header = packed({"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 3, "items": items,
                                  "pad": "y" * 4096})
                reply = send_raw(s.raw, [header, *[b"z"] * 4])
                assert reply["name"] == "TOO_LARGE", reply
                assert f"header frame is {len(header)} bytes" in reply["message"], reply
                assert s.lookup([b"k0"]) == [0]
            finally:
                s.close()
            assert raw.request(Op.PING)[0]["name"] == "OK"
        finally:
            raw.close()


@pytest.mark.parametrize("op", [Op.LOOKUP, Op.PUT, Op.GET, Op.DELETE], ids=lambda o: o.name)
def test_too_many_items_is_too_large(limited, memfd, op):
    with bystander(limited, memfd):
        s = Session(limited.address, namespace())
        try:
            keys = [b"k%d" % i for i in range(17)]
            fields = ({"keys": keys} if op in (Op.LOOKUP, Op.DELETE)
                      else {"items": [[k, 0, 1] for k in keys]})
            reply, _ = s.request(op, **fields)  # PUT: no frames, so the item count is checked
            assert reply["name"] == "TOO_LARGE", reply
            field = "keys" if "keys" in fields else "items"
            assert f"field '{field}' has 17 entries; the limit is 16" in reply["message"], reply
            # exactly max_batch is fine
            keys = keys[:16]
            if op is Op.PUT:
                reply, _ = s.request(op, [b"z"] * 16, items=[[k, 0, 1] for k in keys])
            elif op is Op.GET:
                reply, _ = s.request(op, items=[[k, 0, 1] for k in keys])
            else:
                reply, _ = s.request(op, keys=keys)
            assert reply["name"] == "OK", reply
        finally:
            s.close()


def test_too_many_payload_frames_is_too_large(limited, memfd):
    with bystander(limited, memfd):
        s = Session(limited.address, namespace())
        try:
            items = [[b"k%d" % i, 0, 1] for i in range(17)]
            s.raw.send_frames([packed({"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 77,
                                       "items": items}),
                               *[b"z"] * 17])
            reply, payload = s.raw.recv()
            assert reply["name"] == "TOO_LARGE", reply
            assert "frames" in reply["message"] and "(17)" in reply["message"], reply
            assert s.lookup([b"k0"]) == [0]
            assert limited.cpu()["pending_chunks"] == 0
        finally:
            s.close()


def test_too_many_payload_frames_reply_echoes_the_request_id(limited, memfd):
    with bystander(limited, memfd):
        s = Session(limited.address, namespace())
        try:
            items = [[b"k%d" % i, 0, 1] for i in range(17)]
            s.raw.send_frames([packed({"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 77,
                                       "items": items}),
                               *[b"z"] * 17])
            reply, _ = s.raw.recv()
            assert reply["name"] == "TOO_LARGE", reply
            assert reply["id"] == 77, reply
        finally:
            s.close()


def test_too_many_payload_frames_message_counts_the_clients_frames(limited, memfd):
    with bystander(limited, memfd):
        s = Session(limited.address, namespace())
        try:
            items = [[b"k%d" % i, 0, 1] for i in range(17)]
            s.raw.send_frames([packed({"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 77,
                                       "items": items}),
                               *[b"z"] * 17])
            reply, _ = s.raw.recv()
            assert reply["name"] == "TOO_LARGE", reply
            assert "message has 18 frames" in reply["message"], reply
        finally:
            s.close()


def test_oversize_inline_payload_is_too_large_per_item(limited, memfd):
    with bystander(limited, memfd):
        s = Session(limited.address, namespace())
        try:
            assert s.hello["limits"]["max_inline_bytes"] == 65536
            big, fits = os.urandom(65537), os.urandom(65536)
            reply = s.put([[b"big", 0, len(big)], [b"fits", 0, len(fits)]], [big, fits])
            assert names(reply["results"]) == ["TOO_LARGE", "OK"]
            message = item_errors(reply)[0][1]
            assert "65537" in message and "max_inline_bytes (65536)" in message, message
            assert s.lookup([b"big", b"fits"]) == [0, Tier.CPU]
            reply, _ = s.get([[b"fits", 0, 65537], [b"big", 0, 2**40]])
            assert names(reply["results"]) == ["TOO_LARGE", "TOO_LARGE"]
            assert "65537" in item_errors(reply)[0][1]
            assert limited.cpu()["pending_chunks"] == 0
        finally:
            s.close()
