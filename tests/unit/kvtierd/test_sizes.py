"""parse_size / format_size: the units operators write, and refusals that say what is allowed."""

import pytest

from kvtierd.sizes import format_size, parse_size

UNITS_IN_MESSAGE = ("KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (12345, 12345),
        ("4096", 4096),
        ("64GiB", 64 * 1024**3),
        ("1.5MiB", 1536 * 1024),
        ("10 MB", 10_000_000),
        ("  7kib ", 7 * 1024),
        ("3b", 3),
        ("2T", 2 * 1000**4),
        ("1TiB", 1024**4),
    ],
)
def test_parse_size_accepts(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["", "12XB", "-1", "1.5.5MiB", "GiB", "64 Gi B", None])
def test_parse_size_refusal_names_the_units(value):
    with pytest.raises(ValueError) as info:
        parse_size(value)
    for unit in UNITS_IN_MESSAGE:
        assert unit in str(info.value)


@pytest.mark.parametrize("value", [True, False, -1])
def test_parse_size_refuses_bools_and_negative_ints(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_parse_size_bool_refusal_names_the_units():
    with pytest.raises(ValueError, match="GiB"):
        parse_size(True)


@pytest.mark.parametrize("text, expected", [("2.01MB", 2_010_000), ("2.03KB", 2030)])
def test_parse_size_decimal_fraction_is_exact(text, expected):
    assert parse_size(text) == expected


def test_parse_size_large_integer_string_is_exact():
    assert parse_size(str(2**53 + 1)) == 2**53 + 1


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 * 1024**2, "5.0 MiB"),
        (64 * 1024**3, "64.0 GiB"),
        (3 * 1024**4, "3.0 TiB"),
        (1024**5, "1024.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text
