"""Group commit of the NVMe tier's index rows: one transaction for the write jobs finishing at once.

A write job makes its pages durable (``DataFile.sync``) and then inserts its rows in one SQLite
transaction, which in WAL mode with ``synchronous=FULL`` costs an fsync of the WAL (a device
flush). Jobs that finish together queued on the index's lock, each paying its own flush behind the
others': measured with 2 MiB chunks and two demotion rounds in flight, an insert took 20-47 ms
against 15-30 ms for the job's 20-32 MiB of writes, and the arena pages of a job stay "demoting"
(the next round waits for them) until its rows are in. Here the first job to take the commit lock
inserts the rows of every job waiting behind it too, in one transaction: one flush for all.

What stays the same: a job's rows are queued only after its own ``fdatasync`` (data durable before
the rows that name it), and ``insert`` returns (or raises) only once its rows are committed (or
the transaction that held them rolled back): all or nothing per job, and per group.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

Row = TypeVar("Row")


@dataclass(eq=False)
class _Waiter(Generic[Row]):
    rows: Sequence[Row]
    done: bool = False
    error: BaseException | None = field(default=None)


class GroupCommit(Generic[Row]):
    """``insert(rows)`` from any thread; ``commit(all rows)`` runs once per group, on the thread
    of the group's first caller, never twice at once."""

    def __init__(self, commit: Callable[[list[Row]], None]) -> None:
        self._commit = commit
        self._queue_lock = threading.Lock()  # guards _waiting (held for microseconds)
        self._commit_lock = threading.Lock()  # one group's transaction at a time
        self._waiting: list[_Waiter[Row]] = []
        self.groups = 0  # transactions run (tests, stats)

    def insert(self, rows: Sequence[Row]) -> None:
        me: _Waiter[Row] = _Waiter(rows)
        with self._queue_lock:
            self._waiting.append(me)
        with self._commit_lock:
            if not me.done:  # nobody took our rows yet: commit them and every waiter's
                with self._queue_lock:
                    group, self._waiting = self._waiting, []
                self._run(group)
        if me.error is not None:
            error, me.error = me.error, None
            raise error

    def _run(self, group: list[_Waiter[Row]]) -> None:
        self.groups += 1
        try:
            self._commit([row for waiter in group for row in waiter.rows])
        except BaseException as exc:
            for waiter in group:  # each caller raises its own copy: one traceback per thread
                waiter.error = _copy(exc)
        finally:
            for waiter in group:
                waiter.done = True


def _copy(exc: BaseException) -> BaseException:
    """A fresh exception of ``exc``'s type and arguments (an ``OSError`` keeps its errno, which
    the chain's failure metric is labelled with), chained to nothing."""
    try:
        fresh = type(exc)(*exc.args)
    except Exception:  # a type whose constructor wants other arguments
        fresh = RuntimeError(f"index commit failed: {exc!r}")
    return fresh
