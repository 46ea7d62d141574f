"""A real second storage tier used as the chain's "remote" where Mooncake is absent.

It is the NVMe tier on its own directory (real file, real SQLite index, real I/O threads) with the
two things that make a remote tier different from a local one:

* its index lives "elsewhere": the loop thread knows a key only after a batched existence check
  (``exists_job`` reads the SQLite index on an I/O thread) or after writing it itself, so LOOKUP
  goes through ``TierChain.check`` as it will with Mooncake;
* it can be *unreachable*: ``cut()`` makes every job raise ``TierUnavailable`` (as a master that
  is down would), ``heal()`` ends that; ``hang()`` makes jobs wait (a peer that stopped
  answering) until ``answer()``; ``available()`` is what the tier says about itself.

Not a mock of our components: every byte goes through the real tier, every check is real.
"""

from __future__ import annotations

import threading
from typing import Hashable, Sequence

from kvtierd.protocol import Status, Tier
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.lower import Job, TierUnavailable
from kvtierd.tiers.nvme_lower import NvmeLowerTier


class DirRemoteTier(NvmeLowerTier):
    name = "remote"
    tier = Tier.REMOTE
    checks_existence = True
    shared = True
    retry_s = 5.0
    io_threads = 1  # its own pool, as a remote tier should have

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.known: set[Hashable] = set()  # keys the loop thread may answer from
        self.says_available = True
        self.exists_calls = 0
        self.probe_calls = 0
        self._cut = threading.Event()  # read by jobs on I/O threads
        self._go = threading.Event()  # cleared: jobs hang (a remote that stopped answering)
        self._go.set()

    # -- faults --------------------------------------------------------------------------------
    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()

    def hang(self) -> None:
        self._go.clear()

    def answer(self) -> None:
        self._go.set()

    def available(self) -> bool:
        return self.says_available

    def _reachable(self, job: Job) -> Job:
        def run():
            self._go.wait(60)
            if self._cut.is_set():
                raise TierUnavailable("connection refused (the directory remote is cut off)")
            return job()

        return run

    # -- what a remote tier knows without I/O --------------------------------------------------
    def forget(self) -> None:
        """Drop what the loop thread knows (a restarted node: the objects are still there)."""
        self.known.clear()

    def lookup(self, ikey: Hashable, fingerprint: str) -> tuple[Status, ChunkEntry | None]:
        if ikey not in self.known:
            return Status.MISS, None
        return super().lookup(ikey, fingerprint)

    def peek(self, ikey: Hashable) -> ChunkEntry | None:
        return super().peek(ikey) if ikey in self.known else None

    def unknown(self, ikeys: Sequence[Hashable], fingerprint: str) -> list[Hashable]:
        return [k for k in ikeys if k not in self.known]

    def probe_job(self) -> Job:
        """Reaches the "store" as every job does: refused while cut, waits while hung."""
        self.probe_calls += 1
        return self._reachable(lambda: True)

    def exists_job(self, ikeys: Sequence[Hashable], fingerprint: str) -> Job:
        self.exists_calls += 1
        wanted = set(ikeys)

        def job() -> list[bool]:
            stored = {row.ikey for row in self.db.rows() if row.ikey in wanted}
            return [k in stored for k in ikeys]

        return self._reachable(job)

    def exists_done(self, ikeys: Sequence[Hashable], fingerprint: str,
                    found: list[bool] | None) -> None:
        if found is not None:
            self.known.update(k for k, hit in zip(ikeys, found) if hit)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        del out["direct_io"]  # kvtierd_nvme_direct_io is the NVMe tier's alone
        return out

    # -- bookkeeping that keeps ``known`` honest ----------------------------------------------
    def commit(self, entry: ChunkEntry) -> None:
        super().commit(entry)
        self.known.add(entry.ikey)

    def drop(self, entry: ChunkEntry) -> None:
        self.known.discard(entry.ikey)
        super().drop(entry)

    def write_job(self, items, arena) -> Job:
        return self._reachable(super().write_job(items, arena))

    def read_job(self, entry, arena, dst_runs, dst_segments) -> Job:
        return self._reachable(super().read_job(entry, arena, dst_runs, dst_segments))
