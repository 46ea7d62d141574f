"""Arena pinning: pieces of at most 64 GiB, registered off the caller's thread, readiness and
failure reported, everything registered undone at close. The registrar is the CUDA driver's
two calls; here a recorder stands in for the driver (tests/gpu/ uses the real one)."""

from __future__ import annotations

import importlib.util

import pytest

from kvtierd.tiers.pinning import PIECE_BYTES, ArenaPinner, pieces, split_at_pieces

GiB = 1024**3


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at

    def register(self, address: int, nbytes: int) -> None:
        if len([c for c in self.calls if c[0] == "reg"]) == self.fail_at:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.calls.append(("reg", address, nbytes))

    def unregister(self, address: int) -> None:
        self.calls.append(("unreg", address))


def test_pieces_are_at_most_64_gib_and_cover_the_arena():
    assert PIECE_BYTES == 64 * GiB
    got = pieces(150 * GiB)
    assert got == [(0, 64 * GiB), (64 * GiB, 64 * GiB), (128 * GiB, 22 * GiB)]
    assert pieces(10) == [(0, 10)] and pieces(0) == []
    with pytest.raises(ValueError, match="piece_bytes=0"):
        pieces(10, 0)


def test_split_at_pieces():
    assert split_at_pieces(90, 120, 100) == [(90, 10), (100, 100), (200, 10)]
    assert split_at_pieces(0, 100, 100) == [(0, 100)]


def test_pinning_runs_in_the_background_reports_ready_and_unregisters_at_close():
    rec = Recorder()
    pinner = ArenaPinner(0x10000, 250, piece_bytes=100, registrar=rec)
    assert pinner.stats()["state"] == "off"
    pinner.start()
    assert pinner.wait(5)
    assert pinner.ready and pinner.stats()["pinned_bytes"] == 250
    assert rec.calls == [("reg", 0x10000, 100), ("reg", 0x10064, 100), ("reg", 0x100c8, 50)]
    pinner.close()
    assert rec.calls[3:] == [("unreg", 0x100c8), ("unreg", 0x10064), ("unreg", 0x10000)]
    assert pinner.stats()["pinned_bytes"] == 0


def test_a_failed_piece_is_reported_and_the_pinned_ones_are_undone():
    rec = Recorder(fail_at=1)
    pinner = ArenaPinner(0, 300, piece_bytes=100, registrar=rec)
    pinner.start()
    pinner.wait(5)
    stats = pinner.stats()
    assert stats["state"] == "failed" and "AlreadyRegistered" in stats["reason"]
    assert stats["pinned_bytes"] == 100
    pinner.close()
    assert rec.calls == [("reg", 0, 100), ("unreg", 0)]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_pinning_is_unavailable_with_the_reason():
    pinner = ArenaPinner(0, 100)
    pinner.start()
    pinner.wait(30)
    assert pinner.stats()["state"] == "unavailable"
    assert "CuPy is not installed" in pinner.stats()["reason"]
    pinner.close()
