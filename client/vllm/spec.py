"""``KVTierOffloadingSpec``: kvtierd as the storage of vLLM's ``OffloadingConnector``.

Wiring only: the scheduler-side ``KVTierOffloadingManager`` (lookups and stores answered by the
daemon) and the worker-side ``KVTierOffloadingWorker`` (copies through ``KVTierClient``). Enabled
with ``"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier_client.vllm"`` in
``kv_connector_extra_config``; our own keys start with ``kvtierd_`` (see ``settings``).
"""

from __future__ import annotations

import logging
from typing import Any

import vllm
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from . import SUPPORTED_VLLM_VERSIONS
from .geometry import layout_path, publish, worker_layout
from .manager import CONFIG_INFO_KEYS, UNAVAILABLE_METRIC, KVTierOffloadingManager
from .settings import KVTierSettings
from .specs import kv_cache_config_of_engine
from .worker import KVTierOffloadingWorker

log = logging.getLogger(__name__)


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose offloading interfaces this adapter was not written and tested for.

    Between releases vLLM changes these interfaces without a deprecation period (0.33's
    ``submit_load(expedited=...)`` broke 0.32 workers with a TypeError), so an unknown version
    fails at engine start, not at the first transfer.
    """
    release = version.split("+", 1)[0]
    if release not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(f"kvtierd: vLLM {version} is not supported by kvtier_client.vllm; "
                           f"allowed: vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}")


class KVTierOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {UNAVAILABLE_METRIC: OffloadingCounterMetadata(
            documentation="KV offload lookups answered as misses because kvtierd was down, slow "
                          "or not yet attached (the engine recomputed instead).")}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """Labels of vLLM 0.33's ``vllm:kv_offload_config_info`` (values: the manager's)."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        check_vllm_version(vllm.__version__)
        self.settings = KVTierSettings.from_extra_config(self.extra_config)
        self._manager: KVTierOffloadingManager | None = None
        self._worker: KVTierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVTierOffloadingManager(self.config, self.settings)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            layout, tensors = worker_layout(self.config, kv_caches, self.settings,
                                            kv_cache_config_of_engine())
            for g, reason in layout.skipped_groups:
                log.warning("kvtierd: %s", reason)
            path = layout_path(self.settings, self.config.engine_id, layout.rank)
            publish(layout, path)
            log.info("kvtierd: rank %d layout %s (fingerprint %s) published at %s", layout.rank,
                     layout.tokens_per_chunk, layout.fingerprint[:16], path)
            self._worker = KVTierOffloadingWorker(layout, tensors, self.settings, path)
        return self._worker
