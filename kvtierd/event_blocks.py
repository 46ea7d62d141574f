"""The optional ``blocks`` field of PUT: which engine blocks a chunk covers, for KV events.

The daemon's chunk keys are opaque bytes; a KV-aware router (llm-d's KV-cache manager, Dynamo's
router) knows prefixes by the *engine's* block hashes and token ids. So a client that wants its
chunks announced sends, per PUT item, what vLLM's ``BlockStored`` carries::

    blocks: [entry | None, ...]            one per item, in item order (or the field is absent)
    entry:  {"hashes": [h, ...],           the engine block hashes the chunk covers, in token
                                           order (bin of 1..64 bytes, or uint64); 1..MAX_HASHES
             "parent": h | None,           the hash of the block before the chunk's first one
             "tokens": [int, ...],         the chunk's token ids (uint32), or [] (not sent)
             "block_size": int,            tokens per hash; 0 exactly when "tokens" is []
             "group": int}                 optional: the engine's KV-cache group index

Routers hash ``tokens`` themselves and key removals on ``hashes``; an entry without tokens is a
"this node holds these known blocks too" update, as vLLM's own placeholder events are. Every
bound is checked here: a bad entry fails its item (``BAD_REQUEST``), never the batch, and nothing
unchecked reaches the event stream (Dynamo slices ``tokens`` by ``block_size`` per hash, so an
inconsistent pair would break a router, not only this daemon).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_HASHES = 1024  # engine blocks per chunk (blocks_per_chunk x hashes per block)
MAX_HASH_BYTES = 64
MAX_TOKENS = 65536  # tokens per chunk
MAX_BLOCK_SIZE = 65536
MAX_GROUP = 4096
KEYS = {"hashes", "parent", "tokens", "block_size", "group"}

Hash = bytes | int


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What one stored chunk covers, as the engine names it (see the module docstring)."""

    hashes: tuple[Hash, ...]
    parent: Hash | None = None
    tokens: tuple[int, ...] = ()
    block_size: int = 0
    group: int | None = None

    def without_tokens(self) -> BlockInfo:
        """What is kept after the store event: enough for removals and tier moves (token ids of
        every chunk would cost the daemon more memory than its index)."""
        return BlockInfo(self.hashes, self.parent, (), 0, self.group)


def _hash_problem(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        return "" if 0 < len(value) <= MAX_HASH_BYTES else (
            f"{what} has {len(value)} bytes; allowed: 1..{MAX_HASH_BYTES}")
    if isinstance(value, int) and not isinstance(value, bool):
        return "" if 0 <= value < 2**64 else f"{what} {value} is outside 0..2**64-1"
    return f"{what} is {value!r:.40}; expected bytes or a uint64"


def parse(entry: Any) -> tuple[BlockInfo | None, str]:
    """``(info, "")`` for a valid entry or None; ``(None, why)`` otherwise."""
    if entry is None:
        return None, ""
    if not isinstance(entry, dict):
        return None, f"is {entry!r:.60}; expected a map or nil"
    unknown = set(entry) - KEYS
    if unknown:
        return None, f"has unknown field(s) {sorted(map(str, unknown))!r:.80}; allowed: " + (
            ", ".join(sorted(KEYS)))
    hashes = entry.get("hashes")
    if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_HASHES:
        return None, f"'hashes' must be a list of 1..{MAX_HASHES} block hashes"
    for i, value in enumerate(hashes):
        why = _hash_problem(value, f"'hashes'[{i}]")
        if why:
            return None, why
    parent = entry.get("parent")
    if parent is not None and (why := _hash_problem(parent, "'parent'")):
        return None, why
    tokens = entry.get("tokens", [])
    size = entry.get("block_size", 0)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_BLOCK_SIZE:
        return None, f"'block_size' is {size!r:.40}; allowed: an int in 0..{MAX_BLOCK_SIZE}"
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        return None, f"'tokens' must be a list of at most {MAX_TOKENS} token ids"
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**32 for t in tokens):
        return None, "'tokens' must hold uint32 token ids"
    if len(tokens) != size * len(hashes):
        return None, (f"has {len(tokens)} tokens for {len(hashes)} hashes of block_size {size}; "
                      "allowed: tokens = block_size x hashes (both 0 when no tokens are sent)")
    group = entry.get("group")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)
                              or not 0 <= group <= MAX_GROUP):
        return None, f"'group' is {group!r:.40}; allowed: an int in 0..{MAX_GROUP} or absent"
    return BlockInfo(tuple(hashes), parent, tuple(tokens), size, group), ""
