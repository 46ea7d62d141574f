"""vLLM's KV cache specs -> kvtierd's group kind, window and per-layer page sizes.

vLLM already knows what every group caches: each ``KVCacheGroupSpec`` carries a ``KVCacheSpec``
(``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, ``MLAAttentionSpec``
with its indexer role, ``MambaSpec``, ...) or, for layers of one type whose pages differ (MLA +
lightning-indexer caches, Gemma-4 with the hybrid KV cache manager off), a
``UniformTypeKVCacheSpecs`` holding one spec per layer. Layer attributes such as
``layer.sliding_window`` miss chunked local attention, DeepSeek-V4's SWA caches and Mamba, so the
kind and window are read here from the specs, with vLLM's own ``get_kv_cache_spec_kind``; whatever
it cannot name (cross-attention, encoder-only, an unknown spec) is refused, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)

# vLLM's spec kinds kvtierd can key by the token prefix, and the kvtierd kind each becomes.
# A sink-full-attention layer caches every token like full attention (its sinks are weights).
_KINDS = {
    KVCacheSpecKind.FULL_ATTENTION: "full_attention",
    KVCacheSpecKind.SINK_FULL_ATTENTION: "full_attention",
    KVCacheSpecKind.SLIDING_WINDOW: "sliding_window",
    KVCacheSpecKind.SLIDING_WINDOW_MLA: "sliding_window",
    KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: "chunked_local_attention",
    KVCacheSpecKind.MLA_ATTENTION: "mla",
    KVCacheSpecKind.MAMBA: "mamba",
}
_WHY_REFUSED = {
    KVCacheSpecKind.CROSS_ATTENTION: "its KV depends on the encoder input, not on the token prefix",
    KVCacheSpecKind.ENCODER_ONLY_ATTENTION: "an encoder-only cache is not reused across requests",
}


@dataclass(frozen=True)
class GroupSpec:
    """What kvtierd needs from one vLLM KV cache group's spec."""

    kind: str  # kvtierd kind (layout.KIND_NAMES)
    sliding_window: int | None  # window (sliding) or attention chunk size (chunked local), tokens
    layer_page_bytes: tuple[int, ...]  # real (unpadded) page bytes, one per layer of the group


def translate(group_id: int, spec: KVCacheSpec, layer_names: tuple[str, ...]) -> GroupSpec:
    """kvtierd's view of vLLM group ``group_id``; ValueError for what kvtierd cannot store."""
    vllm_kind = get_kv_cache_spec_kind(spec)
    kind = _KINDS.get(vllm_kind)
    if kind is None:
        why = _WHY_REFUSED.get(vllm_kind, "kvtierd does not know what it caches")
        raise ValueError(f"vLLM group {group_id} ({type(spec).__name__}, kind {vllm_kind.value!r}) "
                         f"cannot be offloaded: {why}; allowed kinds: {sorted(set(_KINDS.values()))}")
    layers = _layer_specs(group_id, spec, layer_names)
    if kind == "mla" and all(_is_indexer(s) for s in layers):
        kind = "mla_indexer"
    return GroupSpec(kind, _window(group_id, kind, layers),
                     tuple(_unpadded_page_bytes(s) for s in layers))


def _layer_specs(group_id: int, spec: KVCacheSpec, layer_names: tuple[str, ...]
                 ) -> list[KVCacheSpec]:
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return [spec] * len(layer_names)
    missing = [n for n in layer_names if n not in spec.kv_cache_specs]
    if missing:
        raise ValueError(f"vLLM group {group_id}: UniformTypeKVCacheSpecs has no spec for layers "
                         f"{missing}; allowed: one spec per layer of the group")
    return [spec.kv_cache_specs[n] for n in layer_names]


def _is_indexer(spec: KVCacheSpec) -> bool:
    return isinstance(spec, MLAAttentionSpec) and spec.cache_role == SparseCacheRole.INDEXER


def _window(group_id: int, kind: str, layers: list[KVCacheSpec]) -> int | None:
    if kind == "sliding_window":
        windows = {s.sliding_window for s in layers}
    elif kind == "chunked_local_attention":
        windows = {s.attention_chunk_size for s in layers}
    else:
        return None
    if len(windows) != 1:
        raise ValueError(f"vLLM group {group_id} ({kind}): its layers have windows "
                         f"{sorted(windows)}; allowed: one window per group")
    return windows.pop()


def _unpadded_page_bytes(spec: KVCacheSpec) -> int:
    """The bytes one block of the layer really holds (vLLM pads pages to align groups)."""
    if isinstance(spec, AttentionSpec):
        return spec.unpadded_page_size_bytes
    if isinstance(spec, MambaSpec):
        return replace(spec, page_size_padded=None).page_size_bytes
    return spec.page_size_bytes


def kv_cache_config_of_engine() -> Any:
    """The ``KVCacheConfig`` the running engine built its KV cache from (worker process).

    ``OffloadingSpec.get_worker`` only receives the canonical tensors, so the group specs are read
    from the KV connector vLLM registered for this worker (``OffloadingConnector`` or our
    subclass); both keep the ``KVCacheConfig`` they were built with.
    """
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    config = getattr(get_kv_transfer_group(), "_kv_cache_config", None) \
        if has_kv_transfer_group() else None
    if config is None:
        raise ValueError("cannot read vLLM's KV cache specs: no KV connector with a KVCacheConfig "
                         "is registered in this worker; allowed: kvtierd as the spec of vLLM's "
                         "OffloadingConnector (or KVTierConnector)")
    return config
