"""CopyEngine: small jobs inline, large ones on a thread that wakes the loop through an eventfd."""

import select
import threading

import pytest

from kvtierd.copy.engine import CopyEngine

INLINE = 1024


@pytest.fixture
def engine():
    engine = CopyEngine(threads=2, inline_bytes=INLINE)
    yield engine
    engine.close()


def wait_for(engine: CopyEngine, count: int, timeout_s: float = 10.0) -> list:
    """Poll the wake fd like the request loop does until ``count`` completions arrived."""
    poller = select.poll()
    poller.register(engine.wake_fd, select.POLLIN)
    out: list = []
    while len(out) < count:
        assert poller.poll(timeout_s * 1000), f"no wake-up within {timeout_s}s"
        out += engine.completions()
    return out


def test_small_job_runs_inline(engine):
    caller = threading.get_ident()
    done = engine.submit(INLINE, lambda: (threading.get_ident(), 42), "ctx")
    assert done == ("ctx", (caller, 42), None)
    assert engine.in_flight == 0
    assert select.select([engine.wake_fd], [], [], 0)[0] == []  # an inline job wakes nobody
    assert engine.completions() == []


def test_large_job_completes_on_a_thread(engine):
    caller = threading.get_ident()
    gate = threading.Event()

    def job():
        assert gate.wait(10)
        return threading.get_ident()

    assert engine.submit(INLINE + 1, job, {"id": 7}) is None
    assert engine.in_flight == 1
    assert engine.completions() == [] and engine.in_flight == 1  # not done yet
    gate.set()
    [(context, worker, error)] = wait_for(engine, 1)
    assert context == {"id": 7} and error is None and worker != caller
    assert engine.in_flight == 0


def test_errors_are_delivered(engine):
    boom = RuntimeError("copy failed")

    def fail():
        raise boom

    context, result, error = engine.submit(1, fail, "inline")
    assert (context, result, error) == ("inline", None, boom)
    assert engine.submit(INLINE * 4, fail, "threaded") is None
    assert wait_for(engine, 1) == [("threaded", None, boom)]
    assert engine.in_flight == 0


def test_many_jobs_all_complete_once(engine):
    for i in range(50):
        assert engine.submit(INLINE + 1 + i, lambda i=i: i * i, i) is None
    done = wait_for(engine, 50)
    assert sorted(done) == [(i, i * i, None) for i in range(50)]
    assert engine.in_flight == 0 and engine.completions() == []
