"""Scheduler side: vLLM's ``OffloadingManager`` answered by kvtierd.

vLLM keeps its own per-group keys and chunk bookkeeping; this manager keeps no index of its own, so
whatever any engine on the node stored is a hit here too. Lookups lease their hits (the daemon then
keeps them for its ``lease_timeout_s``, long enough for the load that follows), and are remembered
for the rest of the scheduler step, since vLLM asks about the same key more than once per step.
A key counts as stored only when every TP rank holds it.

If the daemon is down or slow, lookups are misses and stores are skipped (each index backs off for
``kvtierd_retry_s`` after a failure), counted in ``vllm:kvtierd_unavailable_lookups``: the engine keeps
serving and recomputes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtierd.protocol import Tier

from ..index import KVTierIndex
from .geometry import check_against_config, layout_path, read_published
from .settings import KVTierSettings

log = logging.getLogger(__name__)

UNAVAILABLE_METRIC = "vllm:kvtierd_unavailable_lookups"


class KVTierLoadStoreSpec(LoadStoreSpec):
    """Where offloaded chunks live for a job: their vLLM keys, in the job's group/chunk order."""

    def __init__(self, keys: Collection[OffloadKey]) -> None:
        self.keys: list[bytes] = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"KVTierLoadStoreSpec({len(self.keys)} keys)"


class KVTierOffloadingManager(OffloadingManager):
    def __init__(self, config, settings: KVTierSettings) -> None:
        self.config = config
        self.settings = settings
        self._indexes: list[KVTierIndex] | None = None
        self._next_attach = 0.0
        self._step_tiers: dict[bytes, Tier] = {}
        self._unavailable = 0

    # -- daemon sessions, one per TP rank ---------------------------------------------------------
    def _attach(self) -> list[KVTierIndex] | None:
        """Open the per-rank indexes once every worker has published its layout."""
        if self._indexes is not None or time.monotonic() < self._next_attach:
            return self._indexes
        layouts = []
        try:
            for rank in range(self.config.parallel.world_size):
                layout = read_published(layout_path(self.settings, self.config.engine_id, rank))
                if layout is None:
                    raise ValueError(f"rank {rank} has not published its layout yet")
                check_against_config(layout, self.config)
                layouts.append(layout)
        except (OSError, ValueError) as exc:
            self._next_attach = time.monotonic() + self.settings.retry_s
            log.warning("kvtierd: no worker layout for engine %s (%s); lookups miss, retry in %g s",
                        self.config.engine_id, exc, self.settings.retry_s)
            return None
        self._indexes = [
            KVTierIndex(self.settings.address, namespace=lay.namespace, rank=lay.rank,
                        world_size=lay.world_size,
                        fingerprint=lay.fingerprint, timeout_s=self.settings.timeout_s,
                        retry_s=self.settings.retry_s, token=self.settings.token)
            for lay in layouts]
        log.info("kvtierd: scheduler attached to %s, namespace %s, %d rank(s)",
                 self.settings.address, layouts[0].namespace, len(layouts))
        return self._indexes

    def _tiers(self, keys: list[bytes], lease: bool) -> list[Tier] | None:
        """Per key the outermost tier holding it on every rank; None if the daemon is unavailable."""
        indexes = self._attach()
        if indexes is None:
            return None
        tiers = [Tier.CPU] * len(keys)
        for index in indexes:
            answer = index.lookup(keys, lease=lease)
            if not index.available:
                self._unavailable += len(keys)
                return None
            tiers = [max(a, b) if a and b else Tier.NONE for a, b in zip(tiers, answer)]
        return tiers

    # -- OffloadingManager ------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        key = bytes(key)
        tier = self._step_tiers.get(key)
        if tier is None:
            tiers = self._tiers([key], lease=True)
            tier = tiers[0] if tiers else Tier.NONE
            self._step_tiers[key] = tier
        return LookupResult.HIT if tier else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        tier = self._step_tiers.get(bytes(key))
        return CacheHitSource.DISK if tier == Tier.NVME else CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return KVTierLoadStoreSpec(keys)  # the lookup leased them

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = [bytes(k) for k in keys]
        tiers = self._tiers(keys, lease=False)
        # daemon unavailable: store nothing now (vLLM moves on; a later request stores them)
        new = [k for k, t in zip(keys, tiers) if not t] if tiers is not None else []
        return PrepareStoreOutput(keys_to_store=[OffloadKey(k) for k in new],
                                  store_spec=KVTierLoadStoreSpec(new), evicted_keys=[])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._step_tiers.clear()

    def reset_cache(self) -> None:
        # kvtierd is shared by every engine on the node: one engine must not wipe it.
        self._step_tiers.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        if not self._unavailable:
            return None
        stats = OffloadingConnectorStats()
        stats.increase_counter(UNAVAILABLE_METRIC, self._unavailable)
        self._unavailable = 0
        return stats

    def shutdown(self) -> None:
        for index in self._indexes or ():
            index.close()
        self._indexes = None
