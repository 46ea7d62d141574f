"""GroupCommit: the NVMe write jobs' index rows, committed one transaction per group of jobs that
finish at once, on a real SQLite index and real threads."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow
from kvtierd.tiers.nvme_commit import GroupCommit

META = {"page_bytes": "4096", "nvme_bytes": "1048576"}


def rows_of(job: int, n: int = 3) -> list[IndexRow]:
    return [IndexRow("uid:1000", "ns", 0, f"j{job}-{i}".encode(), "fp", 4000, os.urandom(16),
                     [(job * n + i, 1)]) for i in range(n)]


def stored(db: ChunkIndexDB) -> dict[bytes, bytes]:
    return {r.key: r.checksum for r in db.rows()}


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def run_jobs(group: GroupCommit, jobs: dict[int, list[IndexRow]]
             ) -> tuple[list[threading.Thread], dict[int, BaseException | None]]:
    outcome: dict[int, BaseException | None] = {}

    def job(n: int) -> None:
        try:
            group.insert(jobs[n])
            outcome[n] = None
        except BaseException as exc:  # checked by the test
            outcome[n] = exc

    threads = [threading.Thread(target=job, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    return threads, outcome


def test_jobs_finishing_while_a_commit_runs_share_the_next_transaction(tmp_path):
    """The first job's transaction is held open until three more jobs queued behind it; those
    three are committed together in one more transaction, and every row is in the index."""
    db = ChunkIndexDB(tmp_path / "index.sqlite", META)
    gate = threading.Event()
    calls: list[int] = []

    def commit(rows: list[IndexRow]) -> None:
        calls.append(len(rows))
        if len(calls) == 1:
            assert gate.wait(10)
        db.insert(rows)

    group = GroupCommit(commit)
    first, outcome = run_jobs(group, {0: rows_of(0)})
    wait_for(lambda: calls)  # job 0 is inside its transaction
    more, outcome_more = run_jobs(group, {n: rows_of(n) for n in (1, 2, 3)})
    wait_for(lambda: len(group._waiting) == 3)  # all three queued behind it
    gate.set()
    for t in first + more:
        t.join(10)
    assert outcome == {0: None} and outcome_more == {1: None, 2: None, 3: None}
    assert calls == [3, 9] and group.groups == 2
    expected = {r.key: r.checksum for n in range(4) for r in rows_of(n)}
    assert stored(db).keys() == expected.keys()
    db.close()


def test_a_failed_transaction_fails_every_job_in_it_and_the_next_group_commits(tmp_path):
    """ENOSPC on the group's commit: each of its jobs raises its own OSError with that errno (the
    chain labels the failure by it) and none of their rows is in the index; a later job's
    transaction is a new one, and commits."""
    db = ChunkIndexDB(tmp_path / "index.sqlite", META)
    gate = threading.Event()
    calls: list[int] = []

    def commit(rows: list[IndexRow]) -> None:
        calls.append(len(rows))
        if len(calls) == 1:
            assert gate.wait(10)
            db.insert(rows)
        elif len(calls) == 2:
            raise OSError(errno.ENOSPC, "no space left on device")
        else:
            db.insert(rows)

    group = GroupCommit(commit)
    first, outcome = run_jobs(group, {0: rows_of(0)})
    wait_for(lambda: calls)
    failing, failed = run_jobs(group, {1: rows_of(1), 2: rows_of(2)})
    wait_for(lambda: len(group._waiting) == 2)
    gate.set()
    for t in first + failing:
        t.join(10)
    assert outcome == {0: None}
    assert sorted(failed) == [1, 2]
    errors = [failed[1], failed[2]]
    assert all(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors)
    assert errors[0] is not errors[1]  # one exception (and traceback) per thread
    assert stored(db).keys() == {r.key for r in rows_of(0)}
    group.insert(rows_of(4))
    assert stored(db).keys() == {r.key for n in (0, 4) for r in rows_of(n)}
    assert group.groups == 3
    db.close()


def test_an_exception_without_the_usual_constructor_still_fails_the_job(tmp_path):
    class Odd(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    def commit(rows: list[IndexRow]) -> None:
        raise Odd(1, 2)

    with pytest.raises(RuntimeError, match="Odd"):
        GroupCommit(commit).insert(rows_of(0))
