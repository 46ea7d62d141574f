"""The request checks the PUT/GET fast path relies on (kvtierd.server.requests): the columnar
common-case check must accept exactly what the per-item check accepts without a message, so a
batch it passes is one the item-by-item path would have served in full. Both forms of it run
every case: the compiled one pass (kvtierd.server._items) and the Python columns."""

import random

import pytest

from kvtierd.protocol import MAX_KEY_BYTES, ProtocolError
from kvtierd.server import _items, requests

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


def compiled(items, limit):
    return _items.common_columns(items, limit, MAX_KEY_BYTES)


FORMS = pytest.mark.parametrize("common_columns", [compiled, requests.common_columns_python],
                                ids=["compiled", "python"])


def test_the_compiled_form_is_built_and_used():
    assert requests.NATIVE == "compiled" and requests._items is _items


@FORMS
def test_common_columns_gives_the_columns_of_a_common_batch(common_columns):
    items = [[b"k%d" % i, i * 100, 100] for i in range(50)]
    keys, offsets, sizes = common_columns(items, LIMIT)
    assert keys == tuple(i[0] for i in items) and offsets == tuple(i[1] for i in items)
    assert sizes == (100,) * 50
    assert common_columns([[b"k", LIMIT - 1, 1]], LIMIT) is not None  # the last byte
    assert common_columns([(b"k" * MAX_KEY_BYTES, 0, 1)], LIMIT) is not None
    assert common_columns([[b"k", 2**64, 1]], LIMIT) is None  # beyond 64 bits
    assert common_columns([[b"k", 0, 2**70]], LIMIT) is None
    assert common_columns([], LIMIT) is None
    assert common_columns(items, -1) is None  # inline: no staging


@FORMS
@pytest.mark.parametrize("seed", range(30))
def test_common_columns_refuses_a_batch_with_one_uncommon_item(common_columns, seed):
    rng = random.Random(seed)
    items = [[b"key-%d" % i, i * 512, 512] for i in range(rng.randint(1, 40))]
    column = rng.randrange(3)
    bad = rng.choice(BAD_VALUES[column])
    pos = rng.randrange(len(items))
    items[pos][column] = bad
    assert not per_item_ok(items[pos])
    assert common_columns(items, LIMIT) is None


@pytest.mark.parametrize("seed", range(20))
def test_both_forms_answer_the_same_random_batches(seed):
    """Random batches near every edge (key lengths, the staging's last byte, 64-bit ints), some
    of them all common: the same columns or None from both."""
    rng = random.Random(seed)
    limit = rng.choice([1, 4096, LIMIT])
    common = 0
    for _ in range(200):
        items = []
        for _ in range(rng.randint(1, 6)):
            key, offset = b"k" * rng.randint(1, MAX_KEY_BYTES), rng.randrange(limit)
            nbytes = rng.randint(1, limit - offset)  # a common item, then maybe an edge
            if rng.random() < 0.1:
                key = rng.choice([b"k" * (MAX_KEY_BYTES + 1), b"", "k", bytearray(b"k")])
            if rng.random() < 0.1:
                offset = rng.choice([0, limit - 1, limit, -1, 2**63, 2**64, True, 3.0])
            if rng.random() < 0.1:
                nbytes = rng.choice([1, limit, limit - offset + 1, 0, -1, 2**63 - 1, False])
            items.append(rng.choice([list, tuple])((key, offset, nbytes)))
        want = requests.common_columns_python(items, limit)
        assert compiled(items, limit) == want, items
        common += want is not None
    assert common, "no batch was all common: the case went untested"


def test_items_checks_the_shape_of_every_item():
    assert requests.items({"items": [[b"a", 0, 1], (b"b", 1, 1)]}, 10) == [[b"a", 0, 1],
                                                                          (b"b", 1, 1)]
    for bad in ([[b"a", 0]], [[b"a", 0, 1, 2]], [b"abc"], [{"k": 1}], [[b"a", 0, 1], 7]):
        with pytest.raises(ProtocolError, match=r"items\[\d+\]"):
            requests.items({"items": bad}, 10)


KEY_FORMS = pytest.mark.parametrize(
    "good_keys", [lambda keys: _items.good_keys(keys, MAX_KEY_BYTES), requests.good_keys_python],
    ids=["compiled", "python"])


@KEY_FORMS
def test_good_keys_accepts_exactly_the_keys_key_problem_accepts(good_keys):
    assert good_keys([]) and good_keys([b"k", b"k" * MAX_KEY_BYTES])
    for bad in BAD_VALUES[0]:
        assert requests.key_problem(bad) is not None
        assert not good_keys([b"k", bad]), bad
        assert not good_keys([bad, b"k"]), bad


@pytest.mark.parametrize("seed", range(10))
def test_good_keys_forms_agree_with_the_per_key_check(seed):
    rng = random.Random(seed)
    for _ in range(300):
        keys = [b"k" * rng.randint(1, MAX_KEY_BYTES) for _ in range(rng.randint(0, 6))]
        if keys and rng.random() < 0.3:
            keys[rng.randrange(len(keys))] = rng.choice(BAD_VALUES[0])
        want = all(type(k) is bytes and requests.key_problem(k) is None for k in keys)
        assert _items.good_keys(keys, MAX_KEY_BYTES) is want, keys
        assert requests.good_keys_python(keys) is want, keys
        assert requests.good_keys(keys) is want


def test_triples_is_the_shape_check_of_items():
    assert _items.triples([]) and _items.triples([[b"a", 0, 1], (b"b", 1, 1)])
    for bad in ([[b"a", 0]], [[b"a", 0, 1, 2]], [b"abc"], [{"k": 1}], [[b"a", 0, 1], 7],
                [[b"a", 0, 1], "abc"]):
        assert not _items.triples(bad), bad
    with pytest.raises(TypeError, match="must be a list"):
        _items.triples((1, 2, 3))
