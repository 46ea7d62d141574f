"""The keys of a batch that the capacity-planning ghosts simulate (``kvtierd.ghost``): each key's
64-bit xxh3 seeded by its key space, kept where it is below a tier's sampling threshold.

Why a module: every PUT, GET, DELETE and LOOKUP batch hashes all its keys for a sample of one in
eight or fewer (a tier of a GiB or more); as a ``map`` of ``xxhash.xxh3_64_intdigest`` and a
comparison per key that was about a tenth of the request loop's time per 16 KiB item. The
compiled ``kvtierd._key_sample`` (``setup.py``, optional) does it in one C loop with xxhash's own
``XXH3_64bits_withSeed`` (the ``xxhash`` extension's export, checked here against
``xxh3_64_intdigest`` at import); without it, or where the check fails, the Python forms below
run, with the same answers. ``NATIVE`` says which.

A threshold of ``EVERY`` (2**64, a sample ratio of 1) or more keeps every key.
"""

from __future__ import annotations

import os
from itertools import repeat
from typing import Sequence

import xxhash

from kvtierd import xxhash_exports

EVERY = 1 << 64  # a threshold every 64-bit hash is below
#: The ``xxhash`` extension's exports tried, in order (the one dispatching to the CPU's widest
#: vector unit first; for short keys both run the same scalar code).
XXH3_64_SEEDED_NAMES = ("XXH3_64bits_withSeed_dispatch", "XXH3_64bits_withSeed")


def below_python(keys: Sequence[bytes], seed: int, threshold: int) -> list[int]:
    """The hashes of ``keys`` below ``threshold``, in order."""
    hashed = map(xxhash.xxh3_64_intdigest, keys, repeat(seed))
    return list(hashed) if threshold >= EVERY else [h for h in hashed if h < threshold]


def below_at_python(keys: Sequence[bytes], seed: int, threshold: int
                    ) -> tuple[list[int], list[int]]:
    """``below`` and the positions in ``keys`` of the hashes it kept."""
    hashed = list(map(xxhash.xxh3_64_intdigest, keys, repeat(seed)))
    if threshold >= EVERY:
        return hashed, list(range(len(hashed)))
    at = [i for i, h in enumerate(hashed) if h < threshold]
    return [hashed[i] for i in at], at


def _seeded_address(names: tuple[str, ...] = XXH3_64_SEEDED_NAMES) -> int | None:
    """The address of the first of ``names`` the ``xxhash`` extension exports whose hashes,
    through ``_key_sample``, are ``xxh3_64_intdigest``'s on random keys of the lengths where
    xxh3 changes its method and random seeds; else None (the Python forms run)."""
    try:
        from kvtierd import _key_sample  # noqa: PLC0415 (optional: absent without a compiler)
    except ImportError:
        return None
    keys = [os.urandom(n) for n in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024)]
    seeds = [0, 1, int.from_bytes(os.urandom(8), "little")]
    for address in xxhash_exports.addresses(names):
        if all(
                _key_sample.below(keys, seed, None, address, False)
                == [xxhash.xxh3_64_intdigest(key, seed) for key in keys] for seed in seeds):
            return address
    return None


_ADDRESS = _seeded_address()
#: How batches are sampled: "compiled" (one C loop) or "python".
NATIVE = "compiled" if _ADDRESS is not None else "python"

if _ADDRESS is not None:
    from kvtierd._key_sample import below as _below

    def below(keys: Sequence[bytes], seed: int, threshold: int) -> list[int]:
        """The hashes of ``keys`` below ``threshold``, in order."""
        return _below(keys, seed, None if threshold >= EVERY else threshold, _ADDRESS, False)

    def below_at(keys: Sequence[bytes], seed: int, threshold: int
                 ) -> tuple[list[int], list[int]]:
        """``below`` and the positions in ``keys`` of the hashes it kept."""
        return _below(keys, seed, None if threshold >= EVERY else threshold, _ADDRESS, True)
else:
    below, below_at = below_python, below_at_python
