"""Field validation for request headers: every refusal names the field, the value and the rule."""

from __future__ import annotations

from typing import Any

from kvtierd.protocol import MAX_KEY_BYTES, ProtocolError, Status

Item = tuple[Any, Any, Any]  # (key, offset, nbytes) as received; checked per item


def field(header: dict, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in header:
        raise ProtocolError(Status.BAD_REQUEST, f"field {name!r} is missing; expected {what}")
    value = header[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(
            Status.BAD_REQUEST, f"field {name!r} is {value!r:.80}; expected {what}"
        )
    return value


def batch(header: dict, name: str, limit: int) -> list:
    values = field(header, name, list, f"a list of at most {limit} entries")
    if len(values) > limit:
        raise ProtocolError(
            Status.TOO_LARGE, f"field {name!r} has {len(values)} entries; the limit is {limit}"
        )
    return values


def items(header: dict, limit: int) -> list[Item]:
    out = batch(header, "items", limit)
    for i, item in enumerate(out):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ProtocolError(
                Status.BAD_REQUEST, f"items[{i}] is {item!r:.80}; expected [key, offset, nbytes]"
            )
    return out


def key_problem(key: Any) -> tuple[Status, str] | None:
    """Why ``key`` cannot name a chunk, or None."""
    if not isinstance(key, bytes):
        return Status.BAD_REQUEST, f"key {key!r:.80} is not bytes"
    if not key:
        return Status.BAD_REQUEST, "key is empty"
    if len(key) > MAX_KEY_BYTES:
        return (
            Status.KEY_TOO_LONG,
            f"key of {len(key)} bytes is longer than the {MAX_KEY_BYTES}-byte limit",
        )
    return None
