"""Cutting a batch into copy jobs, and counting a GET reply's results once per batch."""

from __future__ import annotations

from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status
from kvtierd.server.accounting import Accounting
from kvtierd.server.batch import MAX_JOB_BYTES, JobQueue, job_bytes


def test_jobs_spread_a_batch_over_the_copy_threads_up_to_a_bound():
    assert job_bytes([[b"k", 0, 16384]] * 64, 2) == 64 * 16384 // 2
    assert job_bytes([[b"k", 0, 16384]] * 4096, 2) == MAX_JOB_BYTES
    assert job_bytes([[b"k", 0, "bad"]] * 4, 2) == 1  # no estimate: one job per item
    assert job_bytes([], 2) == 1


def test_a_queue_submits_each_job_once_it_holds_the_target_and_the_rest_on_flush():
    submitted: list[tuple[list, int]] = []
    queue = JobQueue(lambda job, nbytes: submitted.append((job, nbytes)), target=10)
    for i in range(7):
        queue.add(i, 4)
    assert submitted == [([0, 1, 2], 12), ([3, 4, 5], 12)]
    queue.flush()
    queue.flush()  # nothing left: no empty job
    assert submitted[2:] == [([6], 4)]


def test_get_results_are_counted_per_item_in_one_pass():
    metrics = DaemonMetrics()
    accounting = Accounting(metrics)
    accounting.get_results([0, 0, int(Status.MISS), 0, int(Status.CHECKSUM_MISMATCH),
                            int(Status.MISS)])
    accounting.get_results([0])
    assert accounting.counts["get_served"] == 4 and accounting.counts["get_failed"] == 3
    value = metrics.registry.get_sample_value
    assert value("kvtierd_get_results_total", {"result": "ok"}) == 4
    assert value("kvtierd_get_results_total", {"result": "miss"}) == 2
    assert value("kvtierd_get_results_total", {"result": "checksum_mismatch"}) == 1
