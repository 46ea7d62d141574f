"""kvtier_client: the engine-worker side of kvtierd.

``KVLayout`` plans per-group chunks (each group chunked by its own ``tokens_per_block`` times
``blocks_per_chunk``), ``KVTierClient`` moves their pages between the paged KV cache and the daemon.
"""

from kvtier_client.client import KVTierClient
from kvtier_client.layout import KIND_NAMES, KVGroup, KVLayout
from kvtier_client.planner import Chunk

__all__ = ["KIND_NAMES", "Chunk", "KVGroup", "KVLayout", "KVTierClient"]
