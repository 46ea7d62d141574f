"""Prefix-chain hashing of token ids.

A chunk key must identify the whole prefix that produced the chunk's KV, not only the chunk's own
tokens: the same 16 tokens after different prefixes have different KV. So the hashes form a chain,
one per complete unit of `tokens_per_hash` tokens:

    h[-1] = ROOT_HASH
    h[i]  = xxh3_128(h[i-1] + canonical_bytes(tokens[i*T:(i+1)*T]))

`canonical_bytes` writes each token as an 8-byte little-endian signed integer, so the digest does not
depend on the host's byte order or on the container type the caller used. A trailing partial unit is
not hashed: its KV is not complete, so it cannot be stored or looked up.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

# The parent of the first unit. A fixed 16-byte constant keeps every hash input the same shape
# (16-byte parent + tokens). The version tag is here so that a future change of the canonical encoding
# changes every key instead of silently colliding with keys written by this one.
ROOT_HASH = b"kvtier/prefix/v1"
assert len(ROOT_HASH) == 16

# Bytes per token in the canonical encoding (int64, little-endian).
TOKEN_BYTES = 8


def canonical_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as concatenated 8-byte little-endian signed integers."""
    try:
        arr = array("q", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in the int64 range: {exc}") from exc
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def prefix_hashes(token_ids: Sequence[int], tokens_per_hash: int) -> list[bytes]:
    """Chain hashes (16-byte digests), one per complete unit of `tokens_per_hash` tokens.

    `result[i]` covers tokens `[0, (i + 1) * tokens_per_hash)`. One pass: the tokens are encoded once
    and each unit is hashed once.
    """
    if isinstance(tokens_per_hash, bool) or not isinstance(tokens_per_hash, int) or tokens_per_hash <= 0:
        raise ValueError(f"tokens_per_hash={tokens_per_hash!r}: must be a positive int")
    n_units = len(token_ids) // tokens_per_hash
    data = memoryview(canonical_bytes(token_ids[: n_units * tokens_per_hash]))
    unit_bytes = tokens_per_hash * TOKEN_BYTES
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, n_units * unit_bytes, unit_bytes):
        parent = digest(parent + data[start : start + unit_bytes])
        out.append(parent)
    return out
