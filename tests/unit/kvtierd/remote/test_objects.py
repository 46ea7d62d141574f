"""Remote object names and headers: identities never share a name; every field is checked."""

from __future__ import annotations

import os

import pytest
import xxhash

from kvtierd.remote import objects


def ikey(tenant="uid:1", namespace="ns", rank=0, key=b"\x01\x02"):
    return ((tenant, namespace, rank), key)


def test_names_differ_for_every_part_of_the_identity() -> None:
    base = objects.object_name("c", ikey(), "fp")
    others = [objects.object_name("c2", ikey(), "fp"),
              objects.object_name("c", ikey(tenant="uid:2"), "fp"),
              objects.object_name("c", ikey(namespace="ns2"), "fp"),
              objects.object_name("c", ikey(rank=1), "fp"),
              objects.object_name("c", ikey(key=b"\x01\x03"), "fp"),
              objects.object_name("c", ikey(), "fp2"),
              # a '/' in a namespace cannot forge another tenant's prefix
              objects.object_name("c", ikey(tenant="uid:1/ns", namespace=""), "fp")]
    assert len({base, *others}) == len(others) + 1
    assert base.startswith(objects.tenant_prefix("c", "uid:1"))
    assert base.endswith("/0102")


def test_header_round_trip_and_every_field_is_checked() -> None:
    name = objects.object_name("c", ikey(), "fp")
    payload = os.urandom(1000)
    digest = xxhash.xxh3_128_digest(payload)
    raw = objects.header_for(name, ikey(), "fp", len(payload), digest).pack()
    assert len(raw) == objects.HEADER_BYTES
    assert objects.check_header(raw, name, ikey(), "fp", len(payload)).checksum == digest
    cases = {
        "tenant": dict(ikey=ikey(tenant="uid:2")),
        "fingerprint": dict(fingerprint="fp2"),
        "name": dict(name=name + "0"),
        "payload length": dict(nbytes=999),
    }
    for field, override in cases.items():
        args = dict(name=name, ikey=ikey(), fingerprint="fp", nbytes=len(payload)) | override
        with pytest.raises(objects.HeaderMismatch, match=field):
            objects.check_header(raw, args["name"], args["ikey"], args["fingerprint"],
                                 args["nbytes"])
    for offset, field in ((0, "magic"), (4, "format version"), (8, "flags")):
        bad = bytearray(raw)
        bad[offset] ^= 0xFF
        with pytest.raises(objects.HeaderMismatch, match=field):
            objects.check_header(bytes(bad), name, ikey(), "fp", len(payload))
    with pytest.raises(objects.HeaderMismatch, match="bytes"):
        objects.check_header(raw[:-1], name, ikey(), "fp", len(payload))


def test_names_carry_the_format_version() -> None:
    """Daemons of two object formats sharing one store miss each other's objects (never read
    them as corrupt, never remove them)."""
    name = objects.object_name("c", ikey(), "fp")
    assert name.startswith(f"kvtierd/v{objects.FORMAT_VERSION}/c/")


def test_names_of_a_batch_are_the_names_one_by_one() -> None:
    keys = [ikey(key=b"\x01"), ikey(namespace="other", key=b"\x02"), ikey(key=b"\xff\x00")]
    assert objects.object_names("c", keys, "fp") == [objects.object_name("c", k, "fp")
                                                     for k in keys]
