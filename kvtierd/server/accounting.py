"""Hit and miss accounting shared by the index and data ops: metrics plus `kvtierd stats` counts."""

from __future__ import annotations

from collections import Counter

from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status, Tier


class Accounting:
    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics
        self.counts: Counter[str] = Counter()

    def hit(self, op: str, tier: Tier) -> None:
        self.counts[f"{op}_hits"] += 1
        self.counts[f"{op}_hits_{tier.name.lower()}"] += 1
        self.metrics.hits.labels(tier.name.lower()).inc()

    def miss(self, op: str, status: Status) -> None:
        self.counts[f"{op}_misses"] += 1
        self.metrics.misses.labels(status.name.lower()).inc()
