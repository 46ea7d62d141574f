"""The kvtierd wire protocol: the one module the daemon and the client both import.

Framing (ZeroMQ, ROUTER in the daemon, DEALER in each client)::

    client -> daemon:  [header] [payload ...]
    daemon -> client:  [header] [payload ...]

(the ROUTER adds/strips the routing-id frame). ``header`` is a msgpack map. Every request header has
``v`` (``PROTOCOL_VERSION``, versioned apart from the package), ``op`` (an ``Op`` number) and ``id``
(an int the reply echoes). Every reply has one envelope: ``v``, ``id``, ``status`` (a ``Status``
number, 0 = OK), ``name`` (the status name) and ``message`` (human-readable, empty on success), plus
the op's own fields. Every request gets a reply, including malformed ones that still carry a routing id.

Payload frames are only used by sessions that registered no shared staging buffer (``inline``):
PUT then carries one frame per item, and a GET reply one frame per item (empty for a miss).

Compatibility rules: op and status numbers are explicit and never reused once retired; fields are only
appended; a daemon answers an unknown ``v`` with ``UNSUPPORTED_VERSION`` naming what it speaks.

Per-op fields (request -> reply):

* HELLO ``namespace: str, world_size: int, rank: int, fingerprint: str, staging: {kind, ...},
  token?: str, client?: map`` -> ``session: int, secret: bytes(16), page_bytes: int, limits: map,
  daemon: str, events: bool`` (``events``: the daemon publishes KV events, so PUT's ``blocks`` is
  worth sending). ``secret`` binds the session to whoever read this reply: **every later request
  of the session carries it** as ``secret`` (compared in constant time). A request without it, or
  with another, does not see the session (LOOKUP/PUT/GET/DELETE/BYE answer ``NO_SESSION``, PING
  does not count as its heartbeat): libzmq lets a peer claim any routing id, so the id alone
  would let a process that reconnects with a closed connection's id take over its session.
  ``world_size`` is 1..4096 and ``0 <= rank < world_size``; strings and the free-form ``client``
  map are bounded (README "Protocol"). The session's *tenant* is never a field: the daemon assigns
  it from the token (a configured tenant's) or the peer's credentials, which the ticket carries.
  ``staging`` is one of (``ticket`` from the staging handshake below, bound to its kind):

  - ``{"kind": "memfd", "ticket": bytes}``: the sealed memfd handed over in the handshake;
  - ``{"kind": "cuda_ipc", "ticket": bytes, "handle": bytes(64), "nbytes": int, "device": int,
    "pci_bus_id"?: str}``: a device buffer (the handshake only bound the credentials);
  - ``{"kind": "inline", "ticket"?: bytes}``: payload frames; the ticket, when given, only carries
    the peer's credentials (remote TCP clients have none). Without a ticket and without a
    configured tenant's token the session would be the shared tenant ``anonymous``, which only a
    daemon with ``anonymous_tenant`` allowing it accepts (by default: a tcp:// socket, never an
    ipc:// one, where every local client can do the handshake); otherwise ``AUTH_FAILED``.

  Protocol 1's ``{"kind": "shm", "name": ...}`` (a /dev/shm file named in HELLO) is refused with
  ``BAD_HANDLE``: a name can be opened, swapped or truncated by others, a sealed memfd cannot.
* PING -> ``handshake: str`` (the path of the staging handshake socket; needs no session or
  token) and is also a session heartbeat.
* LOOKUP ``keys: [bytes], lease?: bool`` -> ``tiers: [int]`` (``Tier`` per key, 0 = miss). With a
  remote tier the reply may wait for one batched existence check of the keys no tier knows.
* PUT ``items: [[key, offset, nbytes], ...]`` -> ``results: [int]`` (``Status`` per item; ``EXISTS``
  means the key was already stored by the same layout and nothing was copied; ``QUOTA_EXCEEDED``
  that the tenant's CPU-tier quota is full of its own chunks that cannot be evicted).
  ``0 <= offset <= 2**62`` and ``1 <= nbytes <= 2**62`` (and inside the staging buffer).
  Optional ``blocks: [entry | nil, ...]``, one per item: the engine block hashes (and optionally
  parent hash, token ids, block size, group) the chunk covers, for the KV events announcing it
  (``kvtierd.event_blocks``; a bad entry fails its item with ``BAD_REQUEST``). Optional, so no
  version change: a daemon before it ignores the field, and a client sends it only when HELLO
  said ``events``.
* GET ``items: [[key, offset, nbytes], ...]`` -> ``results: [int]`` (``OK`` or why it is a miss).
* DELETE ``keys: [bytes]`` -> ``results: [int]``.
* STATS ``token?: str`` -> ``stats: map`` (tiers, chunks, counters; what ``kvtierd stats``
  prints). With ``auth_token`` or ``admin_token`` configured, STATS and CHECK need ``token`` (either
  one) or a session opened with ``auth_token``; otherwise ``AUTH_FAILED``. PING never needs one.
* BYE -> ``{}``; the session's reservations are aborted and its leases released.
* CHECK ``token?: str`` -> ``checked: map`` (what was verified) or ``INTERNAL`` naming the violated
  invariant.

Resource limits (``limits`` in the HELLO reply): a HELLO past ``max_sessions`` and a PUT/GET while
the session has ``max_in_flight_requests`` batches in flight are answered ``BUSY``; GET items of an
inline session past ``max_inline_reply_bytes`` are ``TOO_LARGE``.

Staging handshake (protocol 3). ZeroMQ cannot pass file descriptors nor say who the peer is, so a
Unix *stream* socket beside the ZeroMQ socket does both (``P.hs`` for ``ipc://P``; the
``handshake_socket`` config key otherwise; PING tells its path). A client connects, sends exactly
one msgpack map ``{v: 3, kind: "memfd" | "cuda_ipc" | "inline", nbytes: int}`` (``v`` the integer
``PROTOCOL_VERSION``, nothing after the map, at most ``MAX_HANDSHAKE_BYTES``) and, for ``memfd``
only, exactly one descriptor by SCM_RIGHTS in the same ``sendmsg``; a connection that carries a
second descriptor at any point is refused at once. The daemon reads the peer's uid/gid/pid with
SO_PEERCRED, verifies a memfd (a shmem memfd, not hugetlbfs; a regular file sealed
F_SEAL_SHRINK | F_SEAL_GROW and nothing else, exactly ``nbytes`` bytes, not the arena), maps it,
seals it F_SEAL_FUTURE_WRITE | F_SEAL_SEAL itself (so the client must map its buffer *before*
the handshake: no writable mapping can be made after), checks that it has no holes (none can
appear any more), answers one map ``{status, name, message, ticket: bytes(16), expires_s:
float}`` and closes the connection. The ticket is random, one-time, bound to
the kind, and expires after ``expires_s`` (an unused memfd mapping is then closed); HELLO presents
it. A connection that sends nothing, garbage or too much within the handshake deadline is closed
without blocking anyone else.
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack

#: 3 (7 December 2026): sessions carry HELLO's ``secret`` in every request; the daemon, not the
#: client, seals staging memfds F_SEAL_SEAL (after adding F_SEAL_FUTURE_WRITE). A protocol-2 peer
#: is answered UNSUPPORTED_VERSION, naming 3.
PROTOCOL_VERSION = 3
#: Length of a session's secret (random bytes, HELLO's reply).
SECRET_BYTES = 16

#: Largest handshake message (the msgpack map) the daemon reads; a longer one is refused.
MAX_HANDSHAKE_BYTES = 4096
#: Length of a staging ticket (random bytes).
TICKET_BYTES = 16
#: Staging kinds of the handshake (and of HELLO's ``staging``).
STAGING_KINDS = ("memfd", "cuda_ipc", "inline")

#: Longest chunk key the daemon accepts (DESIGN.md: chunk hashes are opaque bytes, at most 64).
MAX_KEY_BYTES = 64


class Op(enum.IntEnum):
    """Request kinds. Numbers are wire values: append only, never renumber or reuse."""

    HELLO = 1
    PING = 2
    LOOKUP = 3
    PUT = 4
    GET = 5
    DELETE = 6
    STATS = 7
    BYE = 8
    CHECK = 9  # run the daemon's internal invariant checks (tests, operators after an incident)


class Status(enum.IntEnum):
    """Reply and per-item status codes. Numbers are wire values: append only, never reuse."""

    OK = 0
    BAD_MESSAGE = 1  # frame is not a msgpack map / lacks v, op or id
    UNSUPPORTED_VERSION = 2
    UNKNOWN_OP = 3
    NO_SESSION = 4  # op needs a HELLO first (or the session expired)
    BAD_REQUEST = 5  # a field is missing or has the wrong type or value
    TOO_LARGE = 6  # frame, batch or chunk above a documented limit
    KEY_TOO_LONG = 7
    OUT_OF_BOUNDS = 8  # offset/nbytes outside the registered staging buffer
    BAD_HANDLE = 9  # staging handle cannot be opened or is not what it claims
    MISS = 10
    NO_SPACE = 11  # tier full of chunks that cannot be evicted (pending, leased, being read)
    LAYOUT_MISMATCH = 12  # stored chunk was written by another layout fingerprint
    SIZE_MISMATCH = 13  # stored chunk has another size than the reader expects
    AUTH_FAILED = 14
    EXISTS = 15  # PUT of a key already stored (same layout): a successful no-op
    BUSY = 16  # PUT of a key whose first PUT is in flight; or a session/in-flight limit reached
    INTERNAL = 17  # a bug: logged with a traceback, the daemon keeps serving
    SHUTTING_DOWN = 18
    CHECKSUM_MISMATCH = 19  # stored bytes no longer match their checksum: dropped, a miss
    QUOTA_EXCEEDED = 20  # the tenant's CPU-tier quota is full of its own unevictable chunks


#: Per-item PUT statuses a client may count as "the chunk is stored".
STORED = frozenset({Status.OK, Status.EXISTS})


class Tier(enum.IntEnum):
    """Where a chunk lives; LOOKUP answers with these. 0 is a miss."""

    NONE = 0
    CPU = 1
    NVME = 2
    # Held by the remote tier (another node may have stored it); a GET promotes it. Clients that
    # predate it decode an unknown number as a miss (kvtier_client.index), never as a hit.
    REMOTE = 3


class ProtocolError(Exception):
    """A request the daemon refuses as a whole; becomes an error reply with this status."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


#: A ``results`` list at least this long is packed from its bytes (``pack``).
RESULTS_AS_BYTES_MIN = 32


def pack(header: dict[str, Any]) -> bytes:
    """``header`` as msgpack. A long ``results`` list (a batch reply's per-item statuses) whose
    every value is an int in 0..127 is written as its array header and one byte per status,
    which is how msgpack encodes such ints (positive fixints): the same bytes as ``packb``, but
    one C conversion instead of an object walk per status (44 µs for a 4096-item reply, a tenth
    of a DELETE's loop time at 16 KiB). Anything else goes through ``packb`` as it is."""
    results = header.get("results")
    if type(results) is list and len(results) >= RESULTS_AS_BYTES_MIN:
        raw = _fixints(results)
        if raw is not None:
            return _pack_with_results(header, raw)
    return msgpack.packb(header, use_bin_type=True)


def _fixints(values: list) -> bytes | None:
    """``values`` as one byte each if every one is an int (never a bool: statuses are ints) in
    0..127; else None."""
    try:
        raw = bytes(values)
    except (TypeError, ValueError):  # not an int, or outside 0..255
        return None
    return raw if raw.isascii() else None


def _pack_with_results(header: dict[str, Any], raw: bytes) -> bytes:
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(header))]
    for key, value in header.items():
        parts.append(packer.pack(key))
        if key == "results":
            parts.append(packer.pack_array_header(len(raw)))
            parts.append(raw)
        else:
            parts.append(packer.pack(value))
    return b"".join(parts)


def unpack(frame: bytes, max_bytes: int) -> dict[str, Any]:
    """Decode a header frame, refusing anything that is not a bounded msgpack map."""
    if len(frame) > max_bytes:
        raise ProtocolError(
            Status.TOO_LARGE, f"header frame is {len(frame)} bytes; the limit is {max_bytes}"
        )
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(Status.BAD_MESSAGE, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(
            Status.BAD_MESSAGE, f"header must be a msgpack map, got {type(header).__name__}"
        )
    return header


def request(op: Op, request_id: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": int(op), "id": request_id, **fields}


def reply(request_id: Any, status: Status = Status.OK, message: str = "", **fields: Any) -> dict:
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "status": int(status),
        "name": status.name,
        "message": message,
        **fields,
    }


def status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return f"UNKNOWN_STATUS_{code}"
