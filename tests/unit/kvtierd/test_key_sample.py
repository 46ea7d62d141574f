"""kvtierd.key_sample: the compiled sampling loop (kvtierd/_key_sample.c) against its Python form
and xxhash's own xxh3_64_intdigest, and the start-up check that keeps a wrong export out.

The test environment builds the extension (``pip install -e .`` compiles it in place), so the
first test fails where it did not build or its xxh3 did not check out: the ghosts would then
sample in Python.
"""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from kvtierd import _key_sample, key_sample

THRESHOLDS = [0, 1, 1 << 61, (1 << 63) + 12345, (1 << 64) - 1, key_sample.EVERY,
              key_sample.EVERY + 7]


def test_the_extension_is_built_and_its_xxh3_checked_out():
    assert key_sample.NATIVE == "compiled"
    assert key_sample.below is not key_sample.below_python


@pytest.mark.parametrize("seed", range(10))
def test_below_matches_the_python_form_and_xxhash(seed):
    rng = random.Random(seed)
    for _ in range(50):
        keys = [os.urandom(rng.choice([0, 1, 7, 16, 17, 64, 129, 240, 241, 300]))
                for _ in range(rng.randint(0, 40))]
        space_seed = rng.getrandbits(64)
        threshold = rng.choice(THRESHOLDS + [rng.getrandbits(64)])
        hashes = key_sample.below(keys, space_seed, threshold)
        assert hashes == key_sample.below_python(keys, space_seed, threshold)
        assert hashes == [h for h in (xxhash.xxh3_64_intdigest(k, space_seed) for k in keys)
                          if h < threshold]
        kept, at = key_sample.below_at(keys, space_seed, threshold)
        assert (kept, at) == key_sample.below_at_python(keys, space_seed, threshold)
        assert kept == hashes and [xxhash.xxh3_64_intdigest(keys[i], space_seed)
                                   for i in at] == kept


def test_an_export_that_is_not_seeded_xxh3_64_is_never_used():
    """XXH3_64bits (no seed) hashes every key the same for every seed: the check refuses it, as
    it refuses a name the extension does not export; the real one is found after them."""
    assert key_sample._seeded_address(("XXH3_64bits", "no_such_export")) is None
    assert key_sample._seeded_address(("XXH3_64bits", "XXH3_64bits_withSeed")) is not None


def test_bad_keys_are_refused():
    with pytest.raises(TypeError, match=r"keys\[1\] is str; keys are bytes"):
        key_sample.below([b"a", "b"], 1, 1 << 63)
    with pytest.raises(TypeError, match="keys must be a list or tuple of bytes"):
        key_sample.below(None, 1, 1 << 63)
    with pytest.raises(ValueError, match="address is 0"):
        _key_sample.below([b"a"], 1, None, 0, False)
