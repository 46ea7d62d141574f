"""How a chunk is stored in a shared remote store: its object name and its header.

A remote store is shared by every node of a cluster (and maybe by several clusters), so an object
must say whose chunk it is and prove its bytes on every read.

**Name**: ``kvtierd/v<format>/<cluster_id>/<tenant>/<namespace>/<rank>/<fingerprint>/<chunk key>``.
The format version is part of the name, so daemons of two object formats sharing one store never
read (and never remove as corrupt) each other's objects: they miss each other. Tenant and
namespace are percent-encoded (a ``/`` in a namespace can never forge another tenant's prefix); the
layout fingerprint is a 64-bit hash of the writer's fingerprint, so readers of two layouts never
share a name (a reader of another layout simply misses, as in the local tiers); the chunk key is
hex. Nothing a client chooses can make two identities share a name.

**Object** = payload + header (``HEADER_BYTES``, little endian), the header *after* the payload::

    magic "KVTR" | format version u16 | header bytes u16 | flags u32 | payload length u64 |
    xxh3-128(payload) | xxh3-128(tenant) | xxh3-128(fingerprint) | xxh3-128(name)

``check_header`` compares every field with what the reader expects; the chain compares the
checksum with the payload it read. A mismatch anywhere is an integrity failure: the object is
removed and the reader gets a miss. The name's digest in the header catches an object stored under
the wrong name (a bug or tampering in the store), the tenant's digest a forged prefix.

Why the header goes last (format 2; format 1 put it first): Mooncake moves every buffer of a
multi-buffer get as a transfer of its own, so ``[header slot, payload]`` cost a second transfer
per object (a 256 KiB fetch took 1.2x the time of the payload alone). With the header last, a
promotion whose arena pages have room after the payload (``LowerTier.read_slack_bytes``: the CPU
tier reserves that room when a contiguous run is free) reads the whole object as one buffer.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from operator import itemgetter
from typing import Hashable, Sequence
from urllib.parse import quote

import xxhash

from kvtierd.copy.memcpy import checksum as payload_checksum

MAGIC = b"KVTR"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHIQ16s16s16s16s")
HEADER_BYTES = _HEADER.size  # 84
PREFIX = "kvtierd"
_SPACE, _KEY = itemgetter(0), itemgetter(1)  # of an ikey (space, key)


class HeaderMismatch(Exception):
    """A remote object's header does not match what the reader expects (names the field)."""


@dataclass(frozen=True)
class ObjectHeader:
    payload_len: int
    checksum: bytes  # xxh3-128 of the payload, 16 bytes
    tenant_digest: bytes
    fingerprint_digest: bytes
    name_digest: bytes
    version: int = FORMAT_VERSION
    flags: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, HEADER_BYTES, self.flags, self.payload_len,
                            self.checksum, self.tenant_digest, self.fingerprint_digest,
                            self.name_digest)


def digest(text: str) -> bytes:
    return xxhash.xxh3_128_digest(text.encode())


def object_name(cluster_id: str, ikey: Hashable, fingerprint: str) -> str:
    """The object name of chunk ``ikey = ((tenant, namespace, rank), key)`` in layout
    ``fingerprint``."""
    (tenant, namespace, rank), key = ikey  # type: ignore[misc]
    return _space_prefix(cluster_id, tenant, namespace, int(rank), fingerprint) + bytes(key).hex()


def object_names(cluster_id: str, ikeys: Sequence[Hashable], fingerprint: str) -> list[str]:
    """``object_name`` of each key, the space prefix worked out once per space.

    A LOOKUP's keys share one space (the same tuple object): that is checked in C
    (``list.count`` compares identity first) and the names are one concatenation per key,
    without the per-key ``bytes()`` copy and prefix look-up (they were most of a 1024-key
    existence check's own cost, benchmarks/remote_tier.py)."""
    if not ikeys:
        return []
    spaces = list(map(_SPACE, ikeys))
    if spaces.count(spaces[0]) == len(spaces):
        tenant, namespace, rank = spaces[0]
        prefix = _space_prefix(cluster_id, tenant, namespace, int(rank), fingerprint)
        return [prefix + key.hex() for key in map(_KEY, ikeys)]
    prefixes: dict[Hashable, str] = {}
    out = []
    for space, key in ikeys:  # type: ignore[misc]
        prefix = prefixes.get(space)
        if prefix is None:
            tenant, namespace, rank = space
            prefix = prefixes[space] = _space_prefix(cluster_id, tenant, namespace, int(rank),
                                                     fingerprint)
        out.append(prefix + bytes(key).hex())
    return out


@functools.lru_cache(maxsize=4096)
def _space_prefix(cluster_id: str, tenant: str, namespace: str, rank: int,
                  fingerprint: str) -> str:
    """Shared by every chunk of one session (a 1024-key LOOKUP computes it once)."""
    fp = xxhash.xxh3_64_hexdigest(fingerprint.encode())
    return f"{tenant_prefix(cluster_id, tenant)}{quote(namespace, safe='')}/{rank}/{fp}/"


def probe_name(cluster_id: str) -> str:
    """A name no object has (no tenant's prefix: ``:`` is quoted in every tenant name), asked
    about by the remote tier's circuit probe."""
    return f"{PREFIX}/v{FORMAT_VERSION}/{cluster_id}/:probe"


def tenant_prefix(cluster_id: str, tenant: str) -> str:
    """The name prefix of every object of one tenant (for an operator's ``remove_by_regex``)."""
    return f"{PREFIX}/v{FORMAT_VERSION}/{cluster_id}/{quote(tenant, safe='')}/"


def header_for(name: str, ikey: Hashable, fingerprint: str, nbytes: int,
               checksum: bytes) -> ObjectHeader:
    tenant = ikey[0][0]  # type: ignore[index]
    return ObjectHeader(nbytes, checksum, _session_digest(tenant), _session_digest(fingerprint),
                        digest(name))


@functools.lru_cache(maxsize=4096)
def _session_digest(text: str) -> bytes:
    """``digest`` of a tenant or fingerprint: the same for every chunk of a session."""
    return digest(text)


def check_header(raw: bytes | memoryview, name: str, ikey: Hashable, fingerprint: str,
                 nbytes: int) -> ObjectHeader:
    """The header in ``raw`` if it is the header of chunk ``ikey`` (layout ``fingerprint``,
    ``nbytes`` payload bytes) stored as ``name``; else ``HeaderMismatch`` naming the field."""
    if len(raw) != HEADER_BYTES:
        raise HeaderMismatch(f"header of {len(raw)} bytes, expected {HEADER_BYTES}")
    raw = bytes(raw)
    (magic, version, size, flags, length, checksum, tenant_d, fp_d,
     name_d) = _HEADER.unpack(raw)
    expected = header_for(name, ikey, fingerprint, nbytes, checksum)
    if expected.pack() == raw:  # the common case, in one comparison (a fetch checks thousands)
        return expected
    for field, got, want in (
            ("magic", magic, MAGIC), ("format version", version, FORMAT_VERSION),
            ("header bytes", size, HEADER_BYTES), ("flags", flags, 0),
            ("payload length", length, nbytes), ("tenant", tenant_d, expected.tenant_digest),
            ("fingerprint", fp_d, expected.fingerprint_digest),
            ("name", name_d, expected.name_digest)):
        if got != want:
            raise HeaderMismatch(f"{field} {got!r} differs from the expected {want!r}")
    return expected


def whole_chunk_length(whole: bytes | None, name: str, ikey: Hashable, fingerprint: str
                       ) -> int | None:
    """The payload length of ``whole`` (an object read whole, header last) if it is a whole
    chunk of ``ikey`` in ``fingerprint`` stored as ``name``: its header says so and the payload
    has the header's checksum. None otherwise (damaged, cut short, foreign)."""
    length = -1 if whole is None else len(whole) - HEADER_BYTES
    if length <= 0:
        return None
    try:
        header = check_header(whole[length:], name, ikey, fingerprint, length)
    except HeaderMismatch:
        return None
    if payload_checksum(memoryview(whole), [(0, length)]) != header.checksum:
        return None
    return length
