"""kvtier_client.vllm: kvtierd as the storage of vLLM's OffloadingConnector (vLLM 0.32, 0.33).

Enable it with::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"KVTierOffloadingSpec",
      "spec_module_path":"kvtier_client.vllm","kvtierd_address":"ipc:///run/kvtierd/kvtierd.sock",
      "blocks_per_chunk":2}}'

The vLLM-facing classes are imported on first use, so ``kvtier_client.vllm.settings`` and
``kvtier_client.vllm.jobs`` work without vLLM installed.
"""

from __future__ import annotations

import importlib
from typing import Any

# The vLLM releases whose OffloadingConnector interfaces this adapter implements (0.33 added
# expedited loads, the manager lock, config info and on_reset_flushed; see spec, manager, worker).
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")

_LAZY = {
    "KVTierOffloadingSpec": "spec",
    "KVTierOffloadingManager": "manager",
    "KVTierLoadStoreSpec": "manager",
    "KVTierOffloadingWorker": "worker",
    "KVTierConnector": "connector",
}

__all__ = [*_LAZY, "SUPPORTED_VLLM_VERSIONS"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
