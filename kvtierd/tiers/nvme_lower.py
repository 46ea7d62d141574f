"""The NVMe tier as a link of the tier chain: ``NvmeTier`` plus what ``LowerTier`` adds.

``NvmeTier`` keeps its own primitives (reserve/commit/abort, write/read/delete jobs, drop); this
only fills the two places where the chain's contract differs: the LOOKUP answer (``Tier.NVME``) and
the read job, which returns the verified checksum (the chain commits the promoted arena copy with
it) and raises the chain's ``IntegrityError``. Its index is complete, so it never needs existence
checks, and a local disk is never "unavailable" as a whole: its faults are per job.
"""

from __future__ import annotations

from typing import Hashable

from kvtierd.protocol import Tier
from kvtierd.tiers import nvme
from kvtierd.tiers.allocator import Run
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.lower import IntegrityError, Job, LowerTier


class NvmeLowerTier(nvme.NvmeTier, LowerTier):
    name = "nvme"
    tier = Tier.NVME

    def peek(self, ikey: Hashable) -> ChunkEntry | None:
        return self.index.get(ikey)

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
