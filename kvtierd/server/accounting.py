"""Hit and miss accounting of the index and data ops: metrics plus `kvtierd stats` counts.

A chunk the engine asks about is counted once, by the LOOKUP answer: a hit by the tier that has it
(``kvtierd_hits_total``) or a miss by its reason (``kvtierd_misses_total``). The GET that follows
for the hits asks for the same chunks again; counting it as hits too made a real 50 % hit ratio
read 0.67 (two hits per hit, one miss per miss). GET outcomes are therefore their own series,
``kvtierd_get_results_total{result}``, one per GET item: ``ok`` (served) or the lower-case status
that says why a chunk the engine asked for was not served (``miss``: evicted or deleted since the
lookup, ``checksum_mismatch``, ``no_space`` to promote it, ...). Every one of those is a chunk the
engine recomputes.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status, Tier, status_name


class Accounting:
    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics
        self.counts: Counter[str] = Counter()
        self._cpu_hits = metrics.hits.labels("cpu")  # a LOOKUP batch that hit the arena only
        self._get_ok = metrics.get_results.labels(status_name(Status.OK).lower())

    def lookup_cpu_hits(self, n: int) -> None:
        """A LOOKUP batch whose ``n`` keys all hit the CPU tier (the common case): what
        ``lookup_counts({Tier.CPU: n}, {})`` counts, without its label lookups."""
        counts = self.counts
        counts["lookup_hits"] += n
        counts["lookup_hits_cpu"] += n
        self._cpu_hits.inc(n)

    def lookup_hit(self, tier: Tier) -> None:
        self.counts["lookup_hits"] += 1
        self.counts[f"lookup_hits_{tier.name.lower()}"] += 1
        self.metrics.hits.labels(tier.name.lower()).inc()

    def lookup_miss(self, status: Status) -> None:
        self.counts["lookup_misses"] += 1
        self.metrics.misses.labels(status.name.lower()).inc()

    def lookup_counts(self, hits: Mapping[Tier, int], misses: Mapping[Status, int]) -> None:
        """One LOOKUP batch's hits by tier and misses by reason: one update per label."""
        for tier, n in hits.items():
            self.counts["lookup_hits"] += n
            self.counts[f"lookup_hits_{tier.name.lower()}"] += n
            self.metrics.hits.labels(tier.name.lower()).inc(n)
        for status, n in misses.items():
            self.counts["lookup_misses"] += n
            self.metrics.misses.labels(status.name.lower()).inc(n)

    def get_results(self, results: Sequence[int]) -> None:
        """The per-item statuses of one GET reply, exactly as the client receives them: tallied
        first, so a batch costs one counter update per distinct status, not one per item (a
        batch served whole, nearly every one, is one count of its OKs)."""
        n = len(results)
        if n and results.count(Status.OK) == n:
            self.counts["get_served"] += n
            self._get_ok.inc(n)
            return
        for code, n in Counter(results).items():
            self.counts["get_served" if code == Status.OK else "get_failed"] += n
            self.metrics.get_results.labels(status_name(code).lower()).inc(n)
