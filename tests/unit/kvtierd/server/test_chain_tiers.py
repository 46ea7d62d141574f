"""The tier chain with three real tiers: arena → NVMe → a second real tier as "remote"
(``helpers.dir_remote``: the NVMe tier on its own directory whose index the loop only learns
through batched existence checks, and which can be cut off). What these pin down is chain logic
that must hold for Mooncake too: promotion from the third tier, on-commit vs on-evict, the
admission threshold, an unavailable tier skipped (and picked up again), integrity failures."""

from __future__ import annotations

import logging
import os
import select

import pytest
import xxhash

from helpers import chain_stack
from helpers.chain_stack import COMMIT, EVICT, PAGE, SPACE
from kvtierd.protocol import Status, Tier
from kvtierd.tiers.lower import PublishPolicy
from kvtierd.tiers.nvme_file import DATA_NAME


@pytest.fixture
def make(tmp_path):
    yield from chain_stack.stacks(tmp_path)


def test_a_chunk_only_the_third_tier_holds_is_found_by_a_check_and_promoted(make):
    s = make()
    payload = s.put(b"deep")  # on-commit: published to the remote at once
    assert ("stored", "remote", b"deep") in s.events.log
    s.evict_all()  # write-back: demoted to NVMe, then out of the arena
    assert ("stored", "nvme", b"deep") in s.events.log
    assert s.chain.lookup((SPACE, b"deep"), "fp")[1] is Tier.NVME
    assert s.chain.delete((SPACE, b"deep")) is Status.OK  # from every tier...
    s.settle()
    s.put(b"deep2", len(payload))
    s.evict_all()
    s.nvme.delete((SPACE, b"deep2"))  # ...now only the remote holds deep2
    s.remote.forget()  # a node that never saw it: the loop knows nothing about the key
    assert s.chain.lookup((SPACE, b"deep2"), "fp")[0] is Status.MISS
    s.check(b"deep2")
    assert s.remote.exists_calls == 1
    status, tier, _ = s.chain.lookup((SPACE, b"deep2"), "fp")
    assert (status, tier) == (Status.OK, Tier.REMOTE)
    ok, data = s.promote(b"deep2", len(payload))
    assert ok and len(data) == len(payload)
    assert s.metric("kvtierd_bytes_total", direction="promote", tier="remote") == len(payload)
    assert ("stored", "cpu", b"deep2") in s.events.log
    s.invariants()


def test_promotion_from_the_remote_is_byte_exact(make):
    s = make(nvme=False)
    payload = s.put(b"k", 3 * PAGE + 5)
    s.evict_all()  # already on the remote (on-commit): leaves the arena without a write
    assert s.metric("kvtierd_demotions_total") == 0
    assert (SPACE, b"k") not in s.cpu.index
    ok, data = s.promote(b"k", len(payload))
    assert ok and data == payload
    s.invariants()


def test_on_evict_publishes_only_what_leaves_the_tiers_above(make):
    s = make(remote_policy=PublishPolicy(EVICT))
    s.put(b"a")
    assert not any(t == "remote" for _, t, _ in s.events.log), "on-evict published at commit"
    s.evict_all()
    assert s.chain.lookup((SPACE, b"a"), "fp")[1] is Tier.NVME  # NVMe took it, the remote not
    assert s.remote.stats()["chunks"] == 0
    s.chain.trip(s.chain.links[0], OSError("test: NVMe circuit opened"))
    s.put(b"b")
    s.evict_all()  # NVMe skipped: what leaves the arena goes to the remote
    assert s.remote.stats()["chunks"] == 1 and s.nvme.peek((SPACE, b"b")) is None
    assert s.metric("kvtierd_bytes_total", direction="demote", tier="remote") > 0
    s.invariants()


def test_on_commit_publishes_every_committed_chunk(make):
    s = make()
    for key in (b"x", b"y", b"z"):
        s.put(key)
    assert s.remote.stats()["chunks"] == 3 and s.nvme.stats()["chunks"] == 0
    assert s.metric("kvtierd_bytes_total", direction="write_through", tier="remote") > 0
    s.invariants()


def test_admission_threshold_publishes_after_n_reads(make):
    s = make(remote_policy=PublishPolicy(COMMIT, after_reads=2))
    payload = s.put(b"hot")
    s.put(b"cold")
    assert s.remote.stats()["chunks"] == 0
    assert s.read_arena(b"hot") == payload
    assert s.remote.stats()["chunks"] == 0, "published before its second read"
    s.read_arena(b"hot")
    s.read_arena(b"hot")  # a third read publishes nothing more
    assert s.remote.stats()["chunks"] == 1 and s.remote.peek((SPACE, b"hot")) is not None
    s.invariants()


def test_on_evict_admission_drops_chunks_read_too_rarely(make):
    s = make(remote_policy=PublishPolicy(EVICT, after_reads=1), nvme=False)
    s.put(b"never-read")
    s.put(b"read-once")
    s.read_arena(b"read-once")
    s.evict_all()
    assert s.remote.peek((SPACE, b"read-once")) is not None
    assert s.remote.stats()["chunks"] == 1
    assert ("dropped", "cpu", b"never-read") in s.events.log
    assert s.dropped() == {("cpu", "admission"): 1}
    s.invariants()


def test_an_unreachable_tier_is_skipped_then_picked_up_again(make, caplog):
    s = make(nvme=False)
    payload = s.put(b"r", 2 * PAGE)
    s.evict_all()
    s.remote.cut()  # the "master" is down
    with caplog.at_level(logging.WARNING, logger="kvtierd.server.chain"):
        ok, _ = s.promote(b"r", len(payload))
    assert not ok, "a read from an unreachable tier served something"
    assert "remote tier unavailable" in caplog.text
    assert s.metric("kvtierd_tier_available", tier="remote") == 0
    assert s.metric("kvtierd_tier_unavailable_total", tier="remote") == 1
    assert s.metric("kvtierd_integrity_failures_total", tier="remote") == 0
    # skipped by lookups and writes while the circuit is open; the copy is kept, not dropped
    assert s.chain.lookup((SPACE, b"r"), "fp")[0] is Status.MISS
    s.put(b"local-only")
    assert s.remote.peek((SPACE, b"local-only")) is None
    assert s.cpu.lookup((SPACE, b"local-only"), "fp")[1] is not None  # the arena keeps serving
    s.remote.heal()
    s.now[0] += s.remote.retry_s  # due for a probe: started by this lookup, which does not wait
    assert s.chain.lookup((SPACE, b"r"), "fp")[0] is Status.MISS
    assert s.remote.probe_calls == 1
    with caplog.at_level(logging.INFO, logger="kvtierd.server.chain"):
        s.settle()  # the probe answers: the circuit closes
        assert s.chain.lookup((SPACE, b"r"), "fp")[1] is Tier.REMOTE
    assert "remote tier is available again" in caplog.text
    assert s.metric("kvtierd_tier_available", tier="remote") == 1
    ok, data = s.promote(b"r", len(payload))
    assert ok and data == payload
    s.invariants()


def test_the_probe_runs_off_the_request_path_and_the_gauge_waits_for_it(make):
    """Issue 38 item 9: every retry_s the breaker used to half-open and the next LOOKUP was the
    probe, blocking ~4.3 s while Mooncake reconnected, with kvtierd_tier_available at 1 for the
    whole probe. Now the probe is a job of its own: lookups keep skipping the tier (and answer
    at once) until it succeeds, and the gauge reads 0 until then."""
    s = make(nvme=False)
    payload = s.put(b"p", 2 * PAGE)
    s.evict_all()
    s.remote.cut()
    ok, _ = s.promote(b"p", len(payload))
    assert not ok and s.metric("kvtierd_tier_available", tier="remote") == 0
    s.remote.heal()
    s.remote.hang()  # reachable again, but slow to answer (Mooncake reconnecting)
    s.now[0] += s.remote.retry_s
    s.chain.probe()  # what the loop does every iteration and tick
    assert s.remote.probe_calls == 1
    for _ in range(3):  # answered at once, without the tier, while the probe waits
        assert s.chain.lookup((SPACE, b"p"), "fp")[0] is Status.MISS
        assert not s.chain.check([(SPACE, b"q")], "fp", lambda: None)
        s.chain.probe()
    assert s.remote.probe_calls == 1, "a second probe while one is in flight"
    assert s.metric("kvtierd_tier_available", tier="remote") == 0
    s.remote.answer()
    s.settle()
    assert s.metric("kvtierd_tier_available", tier="remote") == 1
    assert s.chain.lookup((SPACE, b"p"), "fp")[1] is Tier.REMOTE
    s.remote.cut()  # a probe that fails keeps the circuit open for another retry_s
    s.remote.forget()
    assert s.chain.check([(SPACE, b"p2")], "fp", lambda: None)
    s.settle()
    assert s.metric("kvtierd_tier_available", tier="remote") == 0
    s.now[0] += s.remote.retry_s
    s.chain.probe()
    s.settle()
    assert s.remote.probe_calls == 2 and s.metric("kvtierd_tier_available", tier="remote") == 0
    s.remote.heal()
    s.now[0] += s.remote.retry_s
    s.chain.probe()
    s.settle()
    assert s.metric("kvtierd_tier_available", tier="remote") == 1
    s.invariants()


def test_a_tier_that_says_it_is_unavailable_is_skipped(make):
    s = make(nvme=False)
    s.put(b"q")
    s.remote.says_available = False
    s.evict_all()
    s.remote.forget()
    assert not s.chain.check([(SPACE, b"q")], "fp", lambda: None), "checked a down tier"
    assert s.chain.lookup((SPACE, b"q"), "fp")[0] is Status.MISS
    s.put(b"q2")
    assert s.remote.peek((SPACE, b"q2")) is None
    assert s.metric("kvtierd_tier_unavailable_total", tier="remote") == 1
    assert s.dropped() == {}  # "q" left the arena with its copy below
    s.evict_all()  # "q2" has none, and no tier below can take it now
    assert (SPACE, b"q2") not in s.cpu.index
    assert s.dropped() == {("cpu", "below_unavailable"): 1}
    s.invariants()


def test_a_demotion_whose_write_fails_is_counted_as_dropped(make):
    s = make(remote_policy=PublishPolicy(EVICT), nvme=False)
    s.put(b"w")
    s.remote.cut()  # reachable when reserved, refused when written
    s.evict_all()
    assert s.remote.peek((SPACE, b"w")) is None and (SPACE, b"w") not in s.cpu.index
    assert s.dropped() == {("cpu", "write_failed"): 1}
    assert s.metric("kvtierd_tier_unavailable_total", tier="remote") == 1
    s.invariants()


def test_a_corrupt_copy_below_is_a_miss_counted_and_dropped(make):
    s = make(nvme=False)
    payload = s.put(b"c", 2 * PAGE)
    s.evict_all()
    entry = s.remote.peek((SPACE, b"c"))
    fd = os.open(s.remote.directory / DATA_NAME, os.O_RDWR)
    try:  # flip one byte of the stored payload
        offset = entry.runs[0][0] * PAGE + 100
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)
    ok, _ = s.promote(b"c", len(payload))
    assert not ok
    assert s.metric("kvtierd_integrity_failures_total", tier="remote") == 1
    assert s.remote.peek((SPACE, b"c")) is None and (SPACE, b"c") not in s.cpu.index
    assert ("dropped", "remote", b"c") in s.events.log
    s.settle()
    s.invariants()


def test_a_hanging_remote_never_delays_the_nvme_tier(make):
    s = make(remote_policy=PublishPolicy(COMMIT, after_reads=1))
    s.put(b"hot")
    s.put(b"cold")
    s.remote.hang()  # the remote stops answering: the publish job holds its own thread
    s.chain.after_read(s.cpu.index[(SPACE, b"hot")])  # admitted: publishing starts, and hangs
    s.chain.flush()
    nvme_pool, remote_pool = s.chain.engines
    assert remote_pool.in_flight == 1
    assert s.cpu.evict(1) and s.cpu.index[(SPACE, b"cold")].demoting  # "hot" is held
    s.chain.flush()
    while nvme_pool.in_flight:  # the demotion completes while the remote still hangs
        select.select([nvme_pool.wake_fd], [], [], 10)
        for job, result, error in nvme_pool.completions():
            s.chain.on_io_done(job, result, error)
    assert s.nvme.peek((SPACE, b"cold")) is not None and remote_pool.in_flight == 1
    s.remote.answer()
    s.settle()
    assert s.remote.peek((SPACE, b"hot")) is not None
    s.invariants()


def test_a_full_arena_keeps_two_demotion_rounds_in_flight(make):
    """Reservations that wait for a round in flight start the next one (never a third), so the
    tier below is already writing when the first round's pages come free; all of it lands."""
    stack = make(remote_policy=PublishPolicy(EVICT), pages=40, low=0.75)  # a round: 10 pages
    cpu = stack.cpu
    payloads = {}
    for i in range(40):
        key = f"k{i}".encode()
        status, entry = cpu.reserve((SPACE, key), "fp", PAGE, owner=1)
        assert status is Status.OK, status
        payloads[key] = os.urandom(PAGE)
        (offset, length), = cpu.segments(entry)
        stack.arena.view[offset:offset + length] = payloads[key]
        cpu.commit(entry, xxhash.xxh3_128_digest(payloads[key]))
    assert cpu.allocator.free_pages == 0
    assert cpu.reserve((SPACE, b"wait-1"), "fp", PAGE, owner=1) == (Status.NO_SPACE, None)
    assert cpu.demoting_pages == cpu.round_pages == 10  # the first round, not yet written
    for n in range(2, 5):
        assert cpu.reserve((SPACE, f"wait-{n}".encode()), "fp", PAGE, owner=1)[0] is Status.NO_SPACE
    assert cpu.demoting_pages == 2 * cpu.round_pages  # the next round, and no third
    stack.invariants()
    stack.settle()
    assert cpu.demoting_pages == 0 and cpu.allocator.free_pages == 20
    demoted = [k for k in payloads if cpu.index.get((SPACE, k)) is None]
    assert len(demoted) == 20 and stack.metric("kvtierd_demotions_total") == 20
    for key in demoted:  # the oldest, written below (NVMe holds 16 pages, the rest went on down)
        ok, data = stack.promote(key, PAGE)
        assert ok and data == payloads[key], key
    stack.invariants()


def test_promotions_of_one_flush_share_a_job_and_a_corrupt_one_fails_alone(make):
    """A GET's promotions are queued and read at the next flush in batched jobs (here one: the
    remote's own pool has one thread); the corrupt chunk among them is the only miss."""
    s = make(nvme=False)
    keys = [b"m0", b"m1", b"m2", b"m3"]
    payloads = {key: s.put(key, 2 * PAGE + 17) for key in keys}
    s.evict_all()
    entry = s.remote.peek((SPACE, b"m2"))
    fd = os.open(s.remote.directory / DATA_NAME, os.O_RDWR)
    try:
        offset = entry.runs[0][0] * PAGE + 3
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x01]), offset)
    finally:
        os.close(fd)
    outcomes: dict[bytes, bool] = {}
    for key in keys:
        status, tier, source = s.chain.lookup((SPACE, key), "fp")
        assert (status, tier) == (Status.OK, Tier.REMOTE)
        status, target = s.cpu.reserve((SPACE, key), "fp", source.nbytes, owner=0)
        assert status is Status.OK
        for off, length in s.cpu.segments(target):
            s.arena.view[off:off + length] = b"\xa5" * length  # poison
        s.chain.promote(tier, source, target,
                        lambda ok, why, key=key: outcomes.__setitem__(key, ok))
    assert not s.chain.engines[1].in_flight, "a promotion started before the flush"
    s.settle()
    assert outcomes == {b"m0": True, b"m1": True, b"m2": False, b"m3": True}
    for key in (b"m0", b"m1", b"m3"):
        assert s.read_arena(key) == payloads[key]
    assert (SPACE, b"m2") not in s.cpu.index and s.remote.peek((SPACE, b"m2")) is None
    assert s.metric("kvtierd_integrity_failures_total", tier="remote") == 1
    assert s.metric("kvtierd_promotions_total") == 3
    assert s.metric("kvtierd_tier_io_duration_seconds_count", tier="remote", op="promote") == 1
    s.invariants()


def test_a_cut_remote_fails_a_batch_of_promotions_as_misses_and_keeps_the_copies(make):
    s = make(nvme=False)
    keys = [b"u0", b"u1", b"u2"]
    for key in keys:
        s.put(key, 2 * PAGE)
    s.evict_all()
    s.remote.cut()
    outcomes = []
    for key in keys:
        _, tier, source = s.chain.lookup((SPACE, key), "fp")
        _, target = s.cpu.reserve((SPACE, key), "fp", source.nbytes, owner=0)
        s.chain.promote(tier, source, target, lambda ok, why: outcomes.append(ok))
    s.settle()
    assert outcomes == [False] * len(keys)
    assert s.metric("kvtierd_tier_unavailable_total", tier="remote") == 1
    assert s.metric("kvtierd_integrity_failures_total", tier="remote") == 0
    assert all(s.remote.peek((SPACE, key)) is not None for key in keys), "copies dropped"
    assert not any((SPACE, key) in s.cpu.index for key in keys)
    s.invariants()


def test_a_round_whose_pages_the_parked_puts_take_starts_the_next_round_then(make):
    """Sustained writes: the PUTs parked on a full arena take a finished round's pages at once
    (``on_space``). The next round starts right then (``chain_io.next_round``), not when a later
    reservation finds the arena full, so the disk writes it while the other round syncs; once a
    round's worth stays free (the writes stopped), no further round starts. Every chunk lands."""
    s = make(remote_policy=PublishPolicy(EVICT), pages=40, low=0.75, nvme_pages=128)
    cpu = s.cpu
    payloads: dict[bytes, bytes] = {}

    def put(key: bytes) -> Status:
        status, entry = cpu.reserve((SPACE, key), "fp", PAGE, owner=1)
        if status is Status.OK:
            payloads[key] = os.urandom(PAGE)
            (offset, length), = cpu.segments(entry)
            s.arena.view[offset:offset + length] = payloads[key]
            cpu.commit(entry, xxhash.xxh3_128_digest(payloads[key]))
        return status

    for i in range(40):
        assert put(f"k{i}".encode()) is Status.OK
    assert put(b"p0") is Status.NO_SPACE and put(b"p1") is Status.NO_SPACE  # two rounds
    assert cpu.demoting_pages == 2 * cpu.round_pages == 20
    parked = [f"p{i}".encode() for i in range(30)]

    def retry_parked() -> None:  # what DataOps.retry_parked does when pages come back
        while parked and cpu.allocator.free_pages:
            assert put(parked.pop(0)) is Status.OK

    s.chain.on_space = retry_parked
    failed = cpu.counters["reserve_no_space"]
    nvme_pool = s.chain.engines[0]
    s.chain.flush()
    select.select([nvme_pool.wake_fd], [], [], 10)
    for job, result, error in nvme_pool.completions():  # the first demotion(s) done
        s.chain.on_io_done(job, result, error)
    assert cpu.allocator.free_pages < cpu.round_pages  # the parked PUTs took the pages...
    assert cpu.demoting_pages >= cpu.round_pages  # ...and the next round is on its way
    assert cpu.counters["reserve_no_space"] == failed  # without a reservation failing first
    s.settle()
    assert not parked and cpu.demoting_pages == 0
    assert cpu.allocator.free_pages >= cpu.round_pages  # the writes stopped: no more rounds
    demoted = [k for k in payloads if cpu.index.get((SPACE, k)) is None]
    assert len(demoted) == 70 - (40 - cpu.allocator.free_pages)
    assert s.metric("kvtierd_demotions_total") == len(demoted)
    for key in set(payloads) - set(demoted):  # room in the arena to read every demoted one back
        assert s.chain.delete((SPACE, key)) is Status.OK
    s.settle()
    for key in demoted:
        ok, data = s.promote(key, PAGE)
        assert ok and data == payloads[key], key
    s.invariants()
