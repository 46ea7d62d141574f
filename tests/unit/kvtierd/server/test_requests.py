"""The request checks the PUT/GET fast path relies on (kvtierd.server.requests): the columnar
common-case check must accept exactly what the per-item check accepts without a message, so a
batch it passes is one the item-by-item path would have served in full."""

import random

import pytest

from kvtierd.protocol import MAX_KEY_BYTES, ProtocolError
from kvtierd.server import requests

LIMIT = 1 << 20


def per_item_ok(item, limit=LIMIT) -> bool:
    """The per-item condition DataOps.put/get test before asking for a message."""
    key, offset, nbytes = item
    return (type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES and type(nbytes) is int
            and type(offset) is int and 0 <= offset and 0 < nbytes and offset + nbytes <= limit)


BAD_VALUES = {  # per column: values one item may carry that the common case refuses
    0: [b"", b"k" * (MAX_KEY_BYTES + 1), "text", 7, None, bytearray(b"k")],
    1: [-1, 1.0, True, None, b"0", LIMIT],
    2: [0, -4, 2.0, False, None, LIMIT + 1],
}


def test_common_columns_gives_the_columns_of_a_common_batch():
    items = [[b"k%d" % i, i * 100, 100] for i in range(50)]
    keys, offsets, sizes = requests.common_columns(items, LIMIT)
    assert list(keys) == [i[0] for i in items] and list(offsets) == [i[1] for i in items]
    assert list(sizes) == [100] * 50
    assert requests.common_columns([[b"k", LIMIT - 1, 1]], LIMIT) is not None  # the last byte
    assert requests.common_columns([[b"k" * MAX_KEY_BYTES, 0, 1]], LIMIT) is not None
    assert requests.common_columns([], LIMIT) is None
    assert requests.common_columns(items, -1) is None  # inline: no staging


@pytest.mark.parametrize("seed", range(30))
def test_common_columns_refuses_a_batch_with_one_uncommon_item(seed):
    rng = random.Random(seed)
    items = [[b"key-%d" % i, i * 512, 512] for i in range(rng.randint(1, 40))]
    column = rng.randrange(3)
    bad = rng.choice(BAD_VALUES[column])
    pos = rng.randrange(len(items))
    items[pos][column] = bad
    assert not per_item_ok(items[pos])
    assert requests.common_columns(items, LIMIT) is None


def test_items_checks_the_shape_of_every_item():
    assert requests.items({"items": [[b"a", 0, 1], (b"b", 1, 1)]}, 10) == [[b"a", 0, 1],
                                                                          (b"b", 1, 1)]
    for bad in ([[b"a", 0]], [[b"a", 0, 1, 2]], [b"abc"], [{"k": 1}], [[b"a", 0, 1], 7]):
        with pytest.raises(ProtocolError, match=r"items\[\d+\]"):
            requests.items({"items": bad}, 10)
