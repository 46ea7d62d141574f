"""Cutting a batch into copy jobs, and counting a GET reply's results once per batch."""

from __future__ import annotations

from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status
from kvtierd.server.accounting import Accounting
import random

from kvtierd.server.batch import MAX_JOB_BYTES, JobQueue, job_bounds, job_bytes
from kvtierd.server.fast_path import Checked


def test_jobs_spread_a_batch_over_the_copy_threads_up_to_a_bound():
    assert job_bytes([[b"k", 0, 16384]] * 64, 2) == 64 * 16384 // 2
    assert job_bytes([[b"k", 0, 16384]] * 4096, 2) == MAX_JOB_BYTES
    assert job_bytes([[b"k", 0, "bad"]] * 4, 2) == 1  # no estimate: one job per item
    assert job_bytes([], 2) == 1


def test_a_batch_leads_with_a_job_per_copy_thread_then_as_few_as_keep_them_busy():
    assert job_bounds(4096, 512, 2, 2048) == [(0, 512), (512, 1024), (1024, 2560), (2560, 4096)]
    assert job_bounds(4096, 512, 0, 2048) == [(i, i + 512) for i in range(0, 4096, 512)]
    assert job_bounds(1024, 512, 2, 2048) == [(0, 512), (512, 1024)]  # no more than the lead
    assert job_bounds(2048, 512, 2, 2048) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    big = job_bounds(100_000, 512, 2, 2048)  # the large jobs are capped
    assert big[:3] == [(0, 512), (512, 1024), (1024, 3072)] and big[-1] == (99_328, 100_000)
    assert job_bounds(0, 512, 2, 2048) == []


def test_job_bounds_cover_every_item_once_in_order():
    rng = random.Random(3)
    for _ in range(500):
        count, step, lead = rng.randint(0, 3000), rng.randint(1, 700), rng.randint(0, 4)
        large = rng.randint(0, 3000)
        bounds = job_bounds(count, step, lead, large)
        assert [i for first, end in bounds for i in range(first, end)] == list(range(count))
        sizes = [end - first for first, end in bounds]
        assert all(0 < size <= max(step, large) for size in sizes)
        assert all(size <= step for size in sizes[:lead])
        # past the lead, no more jobs than the large cap and the threads need
        if lead and count > lead * step:
            rest = count - lead * step
            assert len(sizes) - lead == max(1, -(-rest // min(max(step, large),
                                                            max(step, -(-rest // lead)))))


def test_checked_groups_are_column_slices_cut_by_job_bounds():
    n = 3000
    items = Checked(range(n), [b"k%d" % i for i in range(n)], list(range(0, n * 16, 16)),
                    [16384] * n)
    groups = list(items.groups(512 * 16384, 2))
    assert [len(g.keys) for g in groups] == [512, 512, 988, 988]
    assert [k for g in groups for k in g.keys] == items.keys
    assert [o for g in groups for o in g.offsets] == items.offsets
    assert [i for g in groups for i in g.index] == list(range(n))
    assert [len(g.keys) for g in items.groups(512 * 16384)] == [512] * 5 + [440]
    assert list(items.groups(n * 16384, 2)) == [items]  # one job: the columns as they are
    big = Checked(range(32), [b"k%d" % i for i in range(32)], list(range(32)), [2 << 20] * 32)
    # 2 MiB chunks: 4 a job, all of the target (they balance the copy threads better)
    assert [len(g.keys) for g in big.groups(8 << 20, 2)] == [4] * 8


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
