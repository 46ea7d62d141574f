"""The restart snapshot of KV-event announcements: round trip, taken once, bad files ignored."""

from __future__ import annotations

import os

from kvtierd import event_snapshot
from kvtierd.event_blocks import BlockInfo


def test_round_trip_keeps_the_restorable_tiers_and_the_file_is_taken_once(tmp_path) -> None:
    path = tmp_path / "events.snapshot"
    info = BlockInfo((b"\x01" * 32, 7), parent=b"\x02" * 32, tokens=(1, 2), block_size=1,
                     group=3)
    announced = {("nvme", "uid:1", "org/m/abc", b"k1"): info,
                 ("cpu", "uid:1", "org/m/abc", b"k2"): None,
                 ("remote", "uid:1", "org/m/abc", b"k3"): info}
    assert event_snapshot.save(path, announced) == 2  # never the remote tier
    assert path.stat().st_mode & 0o777 == 0o600
    assert event_snapshot.take(path) == [
        ("nvme", (("uid:1", "org/m/abc", 0), b"k1"), info.without_tokens()),
        ("cpu", (("uid:1", "org/m/abc", 0), b"k2"), None)]
    assert not path.exists() and event_snapshot.take(path) == []


def test_an_unreadable_snapshot_gives_nothing_and_is_removed(tmp_path, caplog) -> None:
    path = tmp_path / "events.snapshot"
    for junk in (os.urandom(64), b"\x2a", b"\x81\xa6format\x02",
                 b"\x82\xa6format\x01\xa4rows\x91\x01"):
        path.write_bytes(junk)
        assert event_snapshot.take(path) == []
        assert not path.exists()
    assert "unreadable" in caplog.text


class Index:
    def __init__(self, keys) -> None:
        self.keys = set(keys)

    def slot(self, ikey) -> int:
        return 0 if ikey in self.keys else -1


def test_only_chunks_the_start_recovered_are_re_announced(tmp_path) -> None:
    path = tmp_path / "events.snapshot"
    space = ("uid:1", "ns", 0)
    event_snapshot.save(path, {("nvme", "uid:1", "ns", b"here"): None,
                               ("nvme", "uid:1", "ns", b"lost"): None,
                               ("cpu", "uid:1", "ns", b"here"): None})
    held = event_snapshot.recovered(path, {"nvme": Index([(space, b"here")]), "cpu": Index([])})
    assert held == [("nvme", (space, b"here"), None)]


def test_a_snapshot_that_cannot_be_written_or_read_is_logged_never_raised(tmp_path, caplog):
    missing = tmp_path / "gone" / "events.snapshot"  # its directory does not exist
    assert event_snapshot.save(missing, {("nvme", "t", "ns", b"k"): None}) == 0
    assert "not written" in caplog.text
    odd = tmp_path / "events.snapshot"
    odd.mkdir()  # not a file
    assert event_snapshot.take(odd) == []
    assert "not used" in caplog.text
