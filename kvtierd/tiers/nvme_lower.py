"""The NVMe tier as a link of the tier chain: ``NvmeTier`` plus what ``LowerTier`` adds.

``NvmeTier`` keeps its own primitives (reserve/commit/abort, write/read/delete jobs, drop); this
only fills the two places where the chain's contract differs: the LOOKUP answer (``Tier.NVME``) and
the read job, which returns the verified checksum (the chain commits the promoted arena copy with
it) and raises the chain's ``IntegrityError``. Its index is complete, so it never needs existence
checks, and a local disk is never "unavailable" as a whole: its faults are per job.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from kvtierd.protocol import Tier
from kvtierd.tiers import nvme
from kvtierd.tiers.allocator import Run
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.lower import IntegrityError, Job, LowerTier


class NvmeLowerTier(nvme.NvmeTier, LowerTier):
    name = "nvme"
    tier = Tier.NVME
    #: Smaller than the default: a job's fdatasync and index commit no longer cost one device
    #: flush each (jobs that finish together share them: ``DataFile.sync``, ``nvme_commit``),
    #: and a demotion round cut into more jobs hands its pages back job by job, so the next round
    #: (``chain_io.next_round``) queues its writes behind the rest of this one instead of after
    #: it. Measured (benchmarks/nvme_tier.py, 2 MiB chunks, 12 runs each, interleaved): demotion
    #: median 0.95x fio against 0.85x with 32 MiB jobs; disk busy 0.90 against 0.87.
    write_job_bytes = 8 * 1024**2

    def peek(self, ikey: Hashable) -> ChunkEntry | None:
        return self.index.get(ikey)

    def holds_any(self, space: tuple, keys: Sequence[bytes]) -> bool:
        found = self.index.key_space(space)  # every chunk here, whatever its state
        return found is not None and not found.keys.keys().isdisjoint(keys)

    def read_job(self, entry: ChunkEntry, arena: Arena, dst_runs: list[Run],
                 dst_segments: list[tuple[int, int]]) -> Job:
        read = super().read_job(entry, arena, dst_runs, dst_segments)

        def job() -> bytes:
            try:
                read()
            except nvme.IntegrityError as exc:
                why = str(exc)
            else:
                return entry.checksum
            # Raised outside the handler: the original's traceback (frames holding arena views)
            # must not live on as this one's context.
            raise IntegrityError(why)

        return job
