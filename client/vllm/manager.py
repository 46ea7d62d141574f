"""Scheduler side: vLLM's ``OffloadingManager`` answered by kvtierd.

vLLM keeps its own per-group keys and chunk bookkeeping; this manager keeps no index of its own, so
whatever any engine on the node stored is a hit here too. Lookups are batched and asynchronous
(``lookups.StepLookups``): a key not known yet is answered ``RETRY``, vLLM defers the request, and at
the end of the step every deferred key goes to the daemon in one leasing LOOKUP per rank, so the
scheduler makes at most one daemon round trip per rank per step, whatever the prompt length. A key
counts as stored only when every TP rank holds it.

vLLM 0.33 holds ``lock`` around every manager call; the manager's own background thread never
touches what that lock guards (its answers come back through a queue), so a plain lock suffices.

If the daemon is down or slow, lookups are misses and stores are skipped (each index backs off for
``kvtierd_retry_s`` after a failure), counted in ``vllm:kvtierd_unavailable_lookups``: the engine keeps
serving and recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
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
from .events import EventFeed
from .geometry import check_against_config, layout_path, read_published
from .lookups import StepLookups
from .settings import KVTierSettings

log = logging.getLogger(__name__)

UNAVAILABLE_METRIC = "vllm:kvtierd_unavailable_lookups"
# Labels of vLLM 0.33's vllm:kv_offload_config_info series (fixed for the engine's lifetime).
CONFIG_INFO_KEYS = ("kvtierd_address", "model", "tokens_per_hash", "blocks_per_chunk",
                    "world_size", "max_model_len")


class KVTierLoadStoreSpec(LoadStoreSpec):
    """Where offloaded chunks live for a job: their vLLM keys, in the job's group/chunk order."""

    def __init__(self, keys: Collection[OffloadKey]) -> None:
        self.keys: list[bytes] = [bytes(k) for k in keys]

    def __repr__(self) -> str:
        return f"KVTierLoadStoreSpec({len(self.keys)} keys)"


class KVTierOffloadingManager(OffloadingManager):
    def __init__(self, config: Any, settings: KVTierSettings) -> None:
        self.config = config
        self.settings = settings
        self._lock = threading.Lock()  # vLLM 0.33's manager lock (vLLM enters it, we never do)
        self._attach_lock = threading.Lock()  # the lookup thread and prepare_store both attach
        self._indexes: list[KVTierIndex] | None = None
        self._next_attach = 0.0
        self._lookups = StepLookups(self._ask)
        self._unavailable = 0  # lookups answered "miss" because the daemon was unavailable
        # vLLM's KV events (take_events): only when the engine publishes them, else nobody drains
        self._events = (EventFeed(settings.events_address)
                        if getattr(config, "enable_kv_cache_events", False) else None)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- daemon sessions, one per TP rank ---------------------------------------------------------
    def _attach(self) -> list[KVTierIndex] | None:
        """Open the per-rank indexes once every worker has published its layout."""
        with self._attach_lock:
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
                log.warning("kvtierd: no worker layout for engine %s (%s); lookups miss, retry in "
                            "%g s", self.config.engine_id, exc, self.settings.retry_s)
                return None
            self._indexes = [
                KVTierIndex(self.settings.address, namespace=lay.namespace, rank=lay.rank,
                            world_size=lay.world_size, fingerprint=lay.fingerprint,
                            timeout_s=self.settings.timeout_s,
                            retry_s=self.settings.retry_s, token=self.settings.token)
                for lay in layouts]
            log.info("kvtierd: scheduler attached to %s, namespace %s, %d rank(s)",
                     self.settings.address, layouts[0].namespace, len(layouts))
            return self._indexes

    def _available(self) -> bool:
        """False while attaching waits for the workers or any rank's daemon session backs off."""
        if self._indexes is None:
            return time.monotonic() >= self._next_attach
        return all(index.available for index in self._indexes)

    def _tiers(self, keys: list[bytes], lease: bool) -> list[Tier] | None:
        """Per key the outermost tier holding it on every rank; None if the daemon is unavailable.

        One LOOKUP per rank (the index splits only batches beyond the daemon's ``max_batch``).
        """
        indexes = self._attach()
        if indexes is None:
            return None
        tiers = [Tier.CPU] * len(keys)
        for index in indexes:
            answer = index.lookup(keys, lease=lease)
            if not index.available:
                return None
            tiers = [max(a, b) if a and b else Tier.NONE for a, b in zip(tiers, answer)]
        return tiers

    def _ask(self, keys: list[bytes]) -> list[Tier] | None:
        """The lookup thread's batch: lease the hits, for the load vLLM plans next step."""
        tiers = self._tiers(keys, lease=True)
        if tiers is None:
            with self._attach_lock:
                self._unavailable += len(keys)
        return tiers

    # -- OffloadingManager ------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        key = bytes(key)
        available = self._available()
        tier = self._lookups.tier(key) if available else self._lookups.known(key)
        if tier is None:
            # not known yet and the daemon is reachable: asked for at the end of this step
            return LookupResult.RETRY if available else self._count_unavailable()
        return LookupResult.HIT if tier else LookupResult.MISS

    def _count_unavailable(self) -> LookupResult:
        with self._attach_lock:
            self._unavailable += 1
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        # vLLM has no "remote store" source of its own: its fallback names one.
        tier = self._lookups.known(bytes(key))
        if tier == Tier.REMOTE:
            return CacheHitSource.EXTERNAL_UNSPECIFIED
        return CacheHitSource.DISK if tier == Tier.NVME else CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return KVTierLoadStoreSpec(keys)  # the lookup leased them

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = [bytes(k) for k in keys]
        tiers = self._tiers(keys, lease=False) if keys else []
        # daemon unavailable: store nothing now (vLLM moves on; a later request stores them)
        new = [k for k, t in zip(keys, tiers) if not t] if tiers is not None else []
        return PrepareStoreOutput(keys_to_store=[OffloadKey(k) for k in new],
                                  store_spec=KVTierLoadStoreSpec(new), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        # the daemon committed (or refused) the chunks already; this only feeds vLLM's KV events
        if success and self._events is not None:
            self._events.stored(bytes(k) for k in keys)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """vLLM publishes these through the engine's own KV-event publisher (``events``)."""
        return self._events.take() if self._events is not None else ()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.end_step()

    def has_pending_work(self) -> bool:
        # deferred requests wait for a batch in flight: keep the engine stepping until it lands
        return self._lookups.pending

    def reset_cache(self) -> None:
        # kvtierd is shared by every engine on the node: one engine must not wipe it.
        self._lookups.clear()

    def on_reset_flushed(self) -> None:
        # vLLM 0.33: the workers finished every job of the reset; answers from before it go too
        self._lookups.clear()

    def config_info(self) -> Sequence[dict[str, Any]]:
        """vLLM 0.33's info metric: fixed facts an operator needs to tell engines apart."""
        return [{
            "kvtierd_address": self.settings.address,
            "model": self.settings.model or self.config.model.name,
            "tokens_per_hash": self.config.cache.tokens_per_hash,
            "blocks_per_chunk": self.config.cache.blocks_per_chunk,
            "world_size": self.config.parallel.world_size,
            "max_model_len": getattr(self.config.model, "max_model_len", 0),  # 0.33; 0.32: 0
        }]

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._attach_lock:
            count, self._unavailable = self._unavailable, 0
        if not count:
            return None
        stats = OffloadingConnectorStats()
        stats.increase_counter(UNAVAILABLE_METRIC, count)
        return stats

    def shutdown(self) -> None:
        self._lookups.close()
        if self._events is not None:
            self._events.close()
        for index in self._indexes or ():
            index.close()
        self._indexes = None
