"""``KVTierConnector``: vLLM's ``OffloadingConnector`` that also reports failed loads.

vLLM 0.32's ``OffloadingConnector`` cannot report a failed transfer, so a load the daemon could not
serve (it died between lookup and load, the chunk failed its checksum) would leave blocks without
their KV. This subclass hands those blocks to vLLM's load-failure recovery
(``get_block_ids_with_load_errors``; with ``"kv_load_failure_policy": "recompute"`` vLLM recomputes
them). Use ``"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier_client.vllm"``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector


class KVTierConnector(OffloadingConnector):
    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        take = getattr(worker, "take_failed_block_ids", None)
        return take() if take is not None else set()
