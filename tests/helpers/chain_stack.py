"""A real tier chain for tests: arena → NVMe → a second real tier as "remote"
(``helpers.dir_remote``: the NVMe tier on its own directory whose index the loop only learns
through batched existence checks, and which can be cut off), driven as the daemon's loop drives it.
``stacks`` is the body of the ``make`` fixture that builds (and closes) such stacks."""

from __future__ import annotations

import os
import select
import uuid

import xxhash

from helpers.dir_remote import DirRemoteTier
from kvtierd.copy.engine import CopyEngine
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status, Tier
from kvtierd.server.chain import ChainEvents, TierChain
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.lower import Publish, PublishPolicy
from kvtierd.tiers.nvme_lower import NvmeLowerTier

PAGE = 64 * 1024
SPACE = ("uid:1000", "ns", 0)
EVICT, COMMIT = Publish.ON_EVICT, Publish.ON_COMMIT


class Recorder(ChainEvents):
    def __init__(self) -> None:
        self.log: list[tuple[str, str, bytes]] = []

    def stored(self, tier, entry):
        self.log.append(("stored", tier, entry.ikey[1]))

    def dropped(self, tier, entry):
        self.log.append(("dropped", tier, entry.ikey[1]))


class Stack:
    def __init__(self, tmp_path, nvme_policy, remote_policy, nvme=True, pages=16, low=0.90,
                 cascade_pages=0, nvme_pages=16):
        self.arena = Arena(f"kvtierd-test-chain-{uuid.uuid4().hex[:8]}", pages * PAGE,
                           prefault=False, lock=False)
        self.cpu = CpuTier(self.arena, PAGE, low_watermark=low)
        self.nvme = NvmeLowerTier(tmp_path / "nvme", nvme_pages * PAGE, PAGE) if nvme else None
        self.remote = DirRemoteTier(tmp_path / "remote", 64 * PAGE, PAGE)
        self.engine = CopyEngine(2, inline_bytes=-1)
        self.metrics = DaemonMetrics()
        self.now = [1000.0]
        lower = [(self.nvme, nvme_policy)] if nvme else []
        lower.append((self.remote, remote_policy))
        self.chain = TierChain(self.cpu, lower, self.engine, self.metrics,
                               clock=lambda: self.now[0], cascade_bytes=cascade_pages * PAGE)
        self.events = self.chain.events = Recorder()

    def put(self, key: bytes, nbytes: int = 2 * PAGE + 17) -> bytes:
        status, entry = self.cpu.reserve((SPACE, key), "fp", nbytes, owner=1)
        assert status is Status.OK, status
        payload = os.urandom(nbytes)
        pos = 0
        for offset, length in self.cpu.segments(entry):
            self.arena.view[offset:offset + length] = payload[pos:pos + length]
            pos += length
        self.cpu.commit(entry, xxhash.xxh3_128_digest(payload))
        self.chain.after_commit(entry)
        self.settle()
        return payload

    def read_arena(self, key: bytes) -> bytes:
        """A GET's copy out of the arena, counted as a read (admission filter)."""
        status, tier, entry = self.chain.lookup((SPACE, key), "fp")
        assert (status, tier) == (Status.OK, Tier.CPU)
        data = b"".join(bytes(self.arena.view[o:o + n]) for o, n in self.cpu.segments(entry))
        self.chain.after_read(entry)
        self.settle()
        return data

    def evict_all(self) -> None:
        self.cpu.evict(self.cpu.num_pages)
        self.settle()

    def settle(self) -> None:
        """What the daemon's loop does: drain every I/O pool of the chain until all is done."""
        self.chain.flush()
        engines = self.chain.engines
        assert len(engines) == 2, "the remote's jobs do not run on a pool of their own"
        while any(e.in_flight for e in engines):
            select.select([e.wake_fd for e in engines], [], [], 10)
            for engine in engines:
                for job, result, error in engine.completions():
                    self.chain.on_io_done(job, result, error)

    def check(self, key: bytes) -> None:
        """What a LOOKUP does for a key no tier knows: one batched existence check."""
        answered = []
        if self.chain.check([(SPACE, key)], "fp", lambda: answered.append(True)):
            self.settle()
            assert answered == [True]

    def promote(self, key: bytes, nbytes: int) -> tuple[bool, bytes]:
        """What a GET does for a hit below: poisoned arena pages, filled by the chain."""
        status, tier, source = self.chain.lookup((SPACE, key), "fp")
        assert status is Status.OK and tier is not Tier.CPU, (status, tier)
        status, target = self.cpu.reserve((SPACE, key), "fp", nbytes, owner=0)
        assert status is Status.OK
        for offset, length in self.cpu.segments(target):
            self.arena.view[offset:offset + length] = b"\xa5" * length  # poison
        outcome = []
        self.chain.promote(tier, source, target, lambda ok, why: outcome.append(ok))
        self.settle()
        if not outcome[0]:
            return False, b""
        return True, self.read_arena(key)

    def metric(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def dropped(self) -> dict[tuple[str, str], float]:
        """``kvtierd_evictions_dropped_total`` by (tier, reason), the non-zero ones."""
        out = {}
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == "kvtierd_evictions_dropped_total" and sample.value:
                    out[(sample.labels["tier"], sample.labels["reason"])] = sample.value
        return out

    def invariants(self) -> None:
        self.cpu.check_invariants()
        self.chain.check_invariants()

    def close(self) -> None:
        self.engine.close()
        self.chain.close()
        self.arena.close(unlink=True)


def stacks(tmp_path):
    """The body of a ``make`` fixture: yields a builder of stacks (each in its own directory
    under ``tmp_path``), and closes every stack it built afterwards."""
    made = []

    def build(nvme_policy=PublishPolicy(EVICT), remote_policy=PublishPolicy(COMMIT), nvme=True,
              **arena):
        made.append(Stack(tmp_path / str(len(made)), nvme_policy, remote_policy, nvme, **arena))
        return made[-1]

    yield build
    for stack in made:
        stack.close()
