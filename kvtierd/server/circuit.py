"""Each lower tier's circuit breaker: whether the chain may ask the tier now.

States, per tier (``Circuit``):

* **closed**: the tier is used, as long as it says it is ``available()``;
* **open**: a job found the tier unreachable (``trip``: ``TierUnavailable``); lookups, reads and
  writes skip it for its ``retry_s``;
* **probing**: ``retry_s`` has passed and the tier's ``probe_job`` (``LowerTier``) runs on the
  tier's own engine; requests keep skipping the tier meanwhile, so none waits for a tier coming
  back (Mooncake's reconnect took ~4 s). The probe's success closes the circuit; its failure
  opens it for another ``retry_s``. A tier without a probe job (NVMe, whose jobs fail fast)
  closes at once and its next job decides.

``kvtierd_tier_available{tier}`` is 1 only while the circuit is closed and the tier says it is
available (so an outage reads 0 for its whole length, probes included);
``kvtierd_tier_unavailable_total{tier}`` counts each change to unavailable; each change is one
log line.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvtierd.metrics import DaemonMetrics
from kvtierd.tiers.lower import Job, LowerTier

log = logging.getLogger("kvtierd.server.chain")  # the chain's logger, as before the split


class Circuit:
    def __init__(self, tier: LowerTier, metrics: DaemonMetrics, clock: Callable[[], float],
                 submit_probe: Callable[[Job], Any]) -> None:
        """``submit_probe(job)`` runs a probe job on the tier's engine; its completion calls
        ``probed``."""
        self.tier = tier
        self.name = tier.name
        self.metrics = metrics
        self.clock = clock
        self.submit_probe = submit_probe
        self.open_until = 0.0  # open (tier skipped) until this monotonic time
        self.up = True  # what the last check said (logged and exported on change)
        self.tripped = False  # opened by a job; closes only once a probe reaches the tier
        self.probing = False
        metrics.tier_available.labels(self.name).set(1)
        metrics.tier_unavailable.labels(self.name)  # primed at 0: alerts need a series

    def usable(self) -> bool:
        """Whether the tier may be asked now (starting its probe when one is due)."""
        if self.tripped:
            self._probe()
        ok = not self.tripped and self.clock() >= self.open_until and self.tier.available()
        if ok != self.up:
            self.up = ok
            self.metrics.tier_available.labels(self.name).set(int(ok))
            if ok:
                log.info("%s tier is available again; lookups and writes use it", self.name)
            else:
                self.metrics.tier_unavailable.labels(self.name).inc()
                log.warning("%s tier reports itself unavailable; lookups and writes skip it, "
                            "the tiers above keep serving", self.name)
        return ok

    def probe(self) -> None:
        """Start the probe if one is due (called every loop iteration and tick, so a tier comes
        back even when no request asks for it)."""
        if self.tripped:
            self.usable()

    def _probe(self) -> None:
        if self.probing or self.clock() < self.open_until:
            return
        job = self.tier.probe_job()
        if job is None:
            self.tripped = False  # the next job decides
            return
        self.probing = True
        self.submit_probe(job)

    def probed(self, error: BaseException | None) -> None:
        """The probe answered: the circuit closes, or (``error``) opens for another
        ``retry_s``."""
        self.probing = False
        if error is None:
            self.tripped = False
            self.open_until = 0.0
            self.usable()  # logs and exports the change at once
        else:
            self.trip(error)

    def trip(self, error: BaseException) -> None:
        """A job found the tier unreachable: skip it for its ``retry_s``, then until a probe
        reaches it."""
        self.tripped = True
        self.open_until = self.clock() + self.tier.retry_s
        if self.up:
            self.up = False
            self.metrics.tier_available.labels(self.name).set(0)
            self.metrics.tier_unavailable.labels(self.name).inc()
            log.warning("%s tier unavailable (%s); skipped for %.1f s, the tiers above keep "
                        "serving", self.name, error, self.tier.retry_s)
