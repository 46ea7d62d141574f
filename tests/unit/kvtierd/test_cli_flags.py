"""Boolean settings are flags with a --no- form; --help is plain text with defaults."""

from __future__ import annotations

import pytest

from kvtierd.cli import build_parser, _overrides


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_boolean_flags_and_their_negations():
    args = parse("--cpu-persistent", "--no-prefault", "--no-mlock", "--no-cuda-pin-arena")
    got = _overrides(args)
    assert got["cpu_persistent"] is True and got["prefault"] is False
    assert got["mlock"] is False and got["cuda_pin_arena"] is False
    assert _overrides(parse("--no-cpu-persistent", "--prefault"))["cpu_persistent"] is False
    untouched = _overrides(parse())  # not given: env / file / default decide
    assert all(untouched[key] is None for key in ("cpu_persistent", "prefault", "mlock"))


def test_a_boolean_flag_takes_no_value(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--cpu-persistent", "true"])
    assert exc.value.code == 2
    assert "unrecognized arguments: true" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["serve"], ["check-config"], ["ping"]])
def test_help_is_plain_text_with_defaults(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text
    if command and command[0] == "serve":
        assert "--no-prefault" in text and "--cpu-persistent" in text
        assert "default: 64.0 KiB" in text  # page_bytes
    if command == ["ping"]:
        assert "(default: 2.0)" in text  # --timeout
