"""The checks every request passes before its handler runs: the envelope (protocol version, an
integer request id, a known op) and the payload frames (only a PUT from an inline session carries
any, one per item, at most ``max_batch``). Each refusal is a ``ProtocolError`` naming the value and
what is allowed; the loop answers it and keeps serving."""

from __future__ import annotations

from typing import Any

from kvtierd.protocol import PROTOCOL_VERSION, Op, ProtocolError, Status


def check_envelope(header: dict) -> Op:
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # not 3.0, not True
        raise ProtocolError(
            Status.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported; this daemon speaks "
            f"{PROTOCOL_VERSION}",
        )
    if not isinstance(header.get("id"), int) or isinstance(header.get("id"), bool):
        raise ProtocolError(Status.BAD_MESSAGE, f"request id {header.get('id')!r} is not an int")
    try:
        return Op(header.get("op"))
    except ValueError:
        raise ProtocolError(
            Status.UNKNOWN_OP,
            f"op {header.get('op')!r} is unknown; known: "
            + ", ".join(f"{o.value} ({o.name})" for o in Op),
        ) from None


def check_frame_count(op: Op, session: Any, count: int, max_batch: int) -> None:
    """Payload frames belong only to PUTs of inline sessions (one per item); ``count`` is the
    message's frames after the routing id (the header and any payload frames), ``session`` the
    sender's (None: it has none)."""
    if count == 1:
        return
    if count > max_batch + 1:
        raise ProtocolError(
            Status.TOO_LARGE,
            f"message has {count} frames; the limit is max_batch + 1 ({max_batch + 1})",
        )
    if op is Op.PUT and session is None:
        return  # answered NO_SESSION next
    if op is not Op.PUT or session is None or session.staging is not None:
        raise ProtocolError(
            Status.BAD_REQUEST,
            f"{op.name} carries {count - 1} payload frame(s); payload frames are only accepted "
            "with a PUT from an inline session",
        )
