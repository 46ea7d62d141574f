"""TierChain on real tiers (arena in /dev/shm, NVMe file in tmp): the races that timing can't reach
from outside — a DELETE landing while a chunk is being demoted or promoted."""

from __future__ import annotations

import os
import select
import uuid

import pytest
import xxhash

from kvtierd.copy.engine import CopyEngine
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status, Tier
from kvtierd.server.chain import TierChain
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.lower import Publish, PublishPolicy
from kvtierd.tiers.nvme_lower import NvmeLowerTier

PAGE = 64 * 1024
SPACE = ("uid:1000", "ns", 0)  # (tenant, namespace, rank)


@pytest.fixture
def stack(tmp_path):
    arena = Arena(f"kvtierd-test-mover-{uuid.uuid4().hex[:8]}", 16 * PAGE, prefault=False,
                  lock=False)
    cpu = CpuTier(arena, PAGE)
    nvme = NvmeLowerTier(tmp_path / "nvme", 64 * PAGE, PAGE)
    engine = CopyEngine(2, inline_bytes=-1)
    mover = TierChain(cpu, [(nvme, PublishPolicy(Publish.ON_EVICT))], engine, DaemonMetrics())
    yield cpu, nvme, engine, mover
    engine.close()
    nvme.close()
    arena.close(unlink=True)


def put(cpu: CpuTier, key: bytes, nbytes: int) -> tuple:
    status, entry = cpu.reserve((SPACE, key), "fp", nbytes, owner=1)
    assert status is Status.OK
    payload = os.urandom(nbytes)
    pos = 0
    for offset, length in cpu.segments(entry):
        cpu.arena.view[offset:offset + length] = payload[pos:pos + length]
        pos += length
    cpu.commit(entry, xxhash.xxh3_128_digest(payload))
    return entry, payload


def drain(engine: CopyEngine, mover: TierChain) -> None:
    while engine.in_flight:
        select.select([engine.wake_fd], [], [], 10)
        for job, result, error in engine.completions():
            mover.on_io_done(job, result, error)


def test_demotion_makes_a_chunk_durable_below_and_frees_the_arena(stack):
    cpu, nvme, engine, mover = stack
    entry, payload = put(cpu, b"a", 3 * PAGE + 5)
    assert mover.demote(entry) and entry.demoting
    assert mover.lookup((SPACE, b"a"), "fp")[1] is Tier.CPU  # readable while being demoted
    mover.flush()
    drain(engine, mover)
    assert (SPACE, b"a") not in cpu.index and cpu.used_bytes == 0
    status, tier, below = mover.lookup((SPACE, b"a"), "fp")
    assert (status, tier) == (Status.OK, Tier.NVME) and below.checksum == entry.checksum
    assert [r.key for r in nvme.db.rows()] == [b"a"]
    cpu.check_invariants()
    nvme.check_invariants()


def test_delete_during_demotion_does_not_resurrect_the_chunk(stack):
    cpu, nvme, engine, mover = stack
    entry, _ = put(cpu, b"gone", 2 * PAGE)
    assert mover.demote(entry)
    mover.flush()  # the write job is running or queued on an I/O thread
    assert mover.delete((SPACE, b"gone")) is Status.OK
    drain(engine, mover)
    assert mover.lookup((SPACE, b"gone"), "fp")[0] is Status.MISS
    mover.flush_deletions()
    drain(engine, mover)
    assert list(nvme.db.rows()) == [], "a deleted chunk's NVMe row survived"
    assert nvme.used_bytes == 0 and cpu.used_bytes == 0
    cpu.check_invariants()
    nvme.check_invariants()


@pytest.mark.parametrize("submitted", [True, False], ids=["read-in-flight", "read-queued"])
def test_delete_during_promotion_answers_a_miss_and_frees_everything(stack, submitted):
    cpu, nvme, engine, mover = stack
    entry, _ = put(cpu, b"p", PAGE)
    mover.demote(entry)
    mover.flush()
    drain(engine, mover)
    _, _, source = mover.lookup((SPACE, b"p"), "fp")
    status, target = cpu.reserve(source.ikey, "fp", source.nbytes, owner=0)
    assert status is Status.OK
    outcome = []
    mover.promote(Tier.NVME, source, target, lambda ok, why: outcome.append(ok))
    if submitted:
        mover.flush()  # promotions are read from the loop's flush, batched per tier
    mover.delete((SPACE, b"p"))  # the arena copy is still PENDING; the NVMe copy goes now
    assert source.doomed and source.ikey not in nvme.index
    assert nvme.take_deletions() is None, "pages freed while a read still uses them"
    mover.flush()
    drain(engine, mover)
    assert outcome == [False]  # the read succeeded, but a doomed source is not promoted
    assert target.ikey not in cpu.index, "the aborted arena target is still indexed"
    mover.flush_deletions()
    drain(engine, mover)
    assert nvme.used_bytes == 0 and cpu.used_bytes == 0
    cpu.check_invariants()
    nvme.check_invariants()
