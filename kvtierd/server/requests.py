"""Field validation for request headers: every refusal names the field, the value and the rule.

Every value is checked here, at the boundary, against its real range before anything else sees
it: ints that SQLite could not bind (``rank = 2**63``) or that no buffer could hold, strings of
any length, nested maps of any depth never get past this module.
"""

from __future__ import annotations

from operator import add
from typing import Any, Sequence

from kvtierd import event_blocks
from kvtierd.protocol import MAX_KEY_BYTES, ProtocolError, Status

try:
    from kvtierd.server import _items
except ImportError:  # built without a C compiler (setup.py: the extension is optional)
    _items = None
#: How ``common_columns`` runs: "compiled" (one pass) or "python".
NATIVE = "compiled" if _items is not None else "python"

Item = tuple[Any, Any, Any]  # (key, offset, nbytes) as received; checked per item

MAX_WORLD_SIZE = 4096  # tensor-parallel ranks of one model
MAX_OFFSET = 2**62  # largest offset or size anywhere (a staging buffer is far smaller)
MAX_NAMESPACE_CHARS = 256
MAX_FINGERPRINT_CHARS = 128
MAX_TOKEN_CHARS = 256
# The free-form ``client`` map of HELLO (pid, library name, ...): logged, never interpreted.
MAX_CLIENT_ENTRIES = 32  # map entries and list items, all levels together
MAX_CLIENT_DEPTH = 2  # a map (1) of scalars or of maps/lists (2) of scalars
MAX_CLIENT_STRING = 256  # characters of a key or a string, bytes of a bin value


def field(header: dict, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in header:
        raise ProtocolError(Status.BAD_REQUEST, f"field {name!r} is missing; expected {what}")
    value = header[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(
            Status.BAD_REQUEST, f"field {name!r} is {value!r:.80}; expected {what}"
        )
    return value


def integer(header: dict, name: str, low: int, high: int) -> int:
    """An int field in ``[low, high]`` (bools are not ints here)."""
    value = field(header, name, int, f"an int in {low}..{high}")
    if not low <= value <= high:
        raise ProtocolError(
            Status.BAD_REQUEST, f"field {name!r} is {value}; allowed: an int in {low}..{high}"
        )
    return value


def text(header: dict, name: str, max_chars: int) -> str:
    """A non-empty string field of at most ``max_chars`` characters."""
    value = field(header, name, str, f"a string of 1..{max_chars} characters")
    if not 0 < len(value) <= max_chars:
        raise ProtocolError(
            Status.BAD_REQUEST,
            f"field {name!r} has {len(value)} characters; allowed: 1..{max_chars}",
        )
    return value


def flag(header: dict, name: str, default: bool) -> bool:
    """An optional bool field."""
    if name not in header:
        return default
    return field(header, name, bool, "true or false")


def client_map(header: dict) -> dict:
    """The optional free-form ``client`` map, bounded in entries, depth and sizes."""
    if "client" not in header:
        return {}
    value = field(header, "client", dict, "a map")
    budget = [MAX_CLIENT_ENTRIES]
    why = _client_problem(value, 1, budget)
    if why:
        raise ProtocolError(Status.BAD_REQUEST, f"field 'client' {why}")
    return value


def _client_problem(value: Any, depth: int, budget: list[int]) -> str:
    if isinstance(value, (dict, list)):
        if depth > MAX_CLIENT_DEPTH:
            return f"nests deeper than {MAX_CLIENT_DEPTH} levels"
        budget[0] -= len(value)
        if budget[0] < 0:
            return f"has more than {MAX_CLIENT_ENTRIES} entries in all"
        pairs = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        for key, item in pairs:
            if key is not None and not (isinstance(key, str) and len(key) <= MAX_CLIENT_STRING):
                return f"has a key {key!r:.40}; allowed: strings of <= {MAX_CLIENT_STRING} chars"
            why = _client_problem(item, depth + 1, budget)
            if why:
                return why
        return ""
    if isinstance(value, (str, bytes)):
        return "" if len(value) <= MAX_CLIENT_STRING else (
            f"has a value of {len(value)} characters; allowed: <= {MAX_CLIENT_STRING}")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return ""
    if isinstance(value, int):
        return "" if -2**63 <= value < 2**63 else f"has an int {value} outside 64 bits"
    return f"has a value of type {type(value).__name__}"


def batch(header: dict, name: str, limit: int) -> list:
    values = field(header, name, list, f"a list of at most {limit} entries")
    if len(values) > limit:
        raise ProtocolError(
            Status.TOO_LARGE, f"field {name!r} has {len(values)} entries; the limit is {limit}"
        )
    return values


def items(header: dict, limit: int) -> list[Item]:
    out = batch(header, "items", limit)
    if (_items.triples(out) if _items is not None
            else _ITEM_TYPES.issuperset(map(type, out)) and set(map(len, out)) == _THREE):
        return out  # every item a [key, offset, nbytes] (the common case: one pass in C)
    for i, item in enumerate(out):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ProtocolError(
                Status.BAD_REQUEST, f"items[{i}] is {item!r:.80}; expected [key, offset, nbytes]"
            )
    return out


_ITEM_TYPES = frozenset((list, tuple))
_THREE = {3}
_BYTES = {bytes}
_INT = {int}

Columns = tuple[Sequence[bytes], Sequence[int], Sequence[int]]


def common_columns(items: list[Item], limit: int) -> Columns | None:
    """``items`` (checked by ``items``) as columns — keys, staging offsets, sizes — when every
    item is the common case: a key of bytes (1..MAX_KEY_BYTES long), int offset >= 0 and
    nbytes > 0 within ``limit`` bytes of shared staging. None as soon as one is not (the caller
    then checks item by item for the exact message). One pass in C where ``kvtierd.server._items``
    was built (``setup.py``), else ``common_columns_python``: the same answers."""
    if _items is not None:
        return _items.common_columns(items, limit, MAX_KEY_BYTES)
    return common_columns_python(items, limit)


def common_columns_python(items: list[Item], limit: int) -> Columns | None:
    """``common_columns`` in Python: every check a C loop over a column (eight passes; at 16 KiB
    chunks one Python condition per item was a tenth of the loop's time per item)."""
    if not items or limit < 0:
        return None
    keys, offsets, sizes = zip(*items)
    if set(map(type, keys)) != _BYTES or set(map(type, offsets + sizes)) != _INT:
        return None  # bool is not int here either: type(True) is bool
    lengths = list(map(len, keys))
    if (min(lengths) == 0 or max(lengths) > MAX_KEY_BYTES or min(offsets) < 0
            or min(sizes) <= 0 or max(map(add, offsets, sizes)) > limit):
        return None
    return keys, offsets, sizes


def good_keys(keys: list) -> bool:
    """Whether every key of a batch (a list) can name a chunk: bytes of 1..MAX_KEY_BYTES. One
    pass in C where ``kvtierd.server._items`` was built, else ``good_keys_python``: the same
    answers. (``key_problem`` of each key then says which one is not, and why.)"""
    if _items is not None:
        return _items.good_keys(keys, MAX_KEY_BYTES)
    return good_keys_python(keys)


def good_keys_python(keys: list) -> bool:
    """``good_keys`` as C loops over the batch: the types in one set, then the lengths."""
    if not keys:
        return True
    if set(map(type, keys)) != _BYTES:
        return False
    lengths = list(map(len, keys))
    return min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES


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


def nbytes_problem(nbytes: Any) -> tuple[Status, str] | None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= MAX_OFFSET:
        return Status.BAD_REQUEST, f"nbytes {nbytes!r:.40} must be a positive int <= {MAX_OFFSET}"
    return None


def offset_problem(offset: Any) -> tuple[Status, str] | None:
    """For items with no staging buffer to check against (inline sessions): a plain range."""
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= MAX_OFFSET:
        return Status.BAD_REQUEST, f"offset {offset!r:.40} must be an int in 0..{MAX_OFFSET}"
    return None


def item_problem(staging: Any, key: Any, offset: Any, nbytes: Any, frame: Any,
                 max_inline_bytes: int) -> tuple[Status, str] | None:
    """Why one PUT/GET item cannot be served, or None. ``staging`` is the session's buffer (None:
    an inline session, whose PUT item ``frame`` is its payload frame; None for a GET)."""
    problem = key_problem(key)
    if problem is not None:
        return problem
    problem = nbytes_problem(nbytes)
    if problem is not None:
        return problem
    if staging is not None:
        why = staging.check_range(offset, nbytes)
        return (Status.OUT_OF_BOUNDS, why) if why else None
    problem = offset_problem(offset)
    if problem is not None:
        return problem
    if nbytes > max_inline_bytes:
        return (
            Status.TOO_LARGE,
            f"inline chunk of {nbytes} bytes is above max_inline_bytes ({max_inline_bytes})",
        )
    if frame is not None and len(frame) != nbytes:
        return Status.SIZE_MISMATCH, f"payload frame has {len(frame)} bytes, item says {nbytes}"
    return None


def blocks(header: dict, count: int) -> list | None:
    """PUT's optional ``blocks`` (kvtierd.event_blocks): one entry per item, or absent. Each entry
    is parsed to a ``BlockInfo``, None, or the reason it is refused (a str: its item fails)."""
    if header.get("blocks") is None:
        return None
    values = field(header, "blocks", list, f"a list of {count} entries (one per item) or nil")
    if len(values) != count:
        raise ProtocolError(Status.BAD_REQUEST, f"field 'blocks' has {len(values)} entries; "
                            f"allowed: one per item ({count})")
    return [info if not why else why for info, why in map(event_blocks.parse, values)]


def block_problem(parsed: list | None, i: int) -> tuple[Status, str] | None:
    if parsed is None or not isinstance(parsed[i], str):
        return None
    return Status.BAD_REQUEST, f"blocks[{i}] {parsed[i]}"
