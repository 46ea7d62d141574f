"""A bounded pool of copy threads whose completions wake the request loop.

The loop submits a job (a plain callable doing memmoves) with a context; when the job ends its
``(context, result, error)`` is queued and an eventfd is written, which the loop polls next to its
ZeroMQ socket. So the loop never blocks on a copy and never touches tier state from another thread:
tier updates (commit, abort, release) happen when the loop drains ``completions()``.

Small jobs run inline on the loop thread: handing them to a thread costs more than the copy.
"""

from __future__ import annotations

import logging
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

log = logging.getLogger(__name__)

Completion = tuple[Any, Any, BaseException | None]


class CopyEngine:
    def __init__(self, threads: int, inline_bytes: int = 256 * 1024) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtierd-copy")
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.inline_bytes = inline_bytes
        self.in_flight = 0

    def submit(self, nbytes: int, job: Callable[[], Any], context: Any) -> Completion | None:
        """Run ``job``; return its completion now if it ran inline, else None (see completions)."""
        if nbytes <= self.inline_bytes:
            return self._run(job, context)
        self.in_flight += 1
        self._pool.submit(self._run_and_wake, job, context)
        return None

    @staticmethod
    def _run(job: Callable[[], Any], context: Any) -> Completion:
        try:
            return context, job(), None
        except BaseException as exc:  # reported to the loop, which aborts and answers
            return context, None, exc

    def _run_and_wake(self, job: Callable[[], Any], context: Any) -> None:
        self._done.put(self._run(job, context))
        os.eventfd_write(self.wake_fd, 1)

    def completions(self) -> list[Completion]:
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass
        out: list[Completion] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self.wake_fd)
