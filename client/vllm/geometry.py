"""vLLM's group configuration -> ``KVLayout``, and the layout file a worker publishes.

Worker side: each offloaded group of vLLM's ``OffloadingConfig`` becomes one ``KVGroup`` with the
group's own ``tokens_per_block`` and the real (unpadded) page bytes of the registered tensors;
``blocks_per_chunk`` and ``tokens_per_hash`` are vLLM's; TP rank and world size come from its
parallel config. The fingerprint therefore guards every chunk against any other geometry.

Scheduler side: the scheduler never sees the KV tensors, so it cannot know the page bytes; it reads
the layout each worker rank published (a small JSON file per engine and rank, written atomically)
and asks the daemon under exactly that namespace and fingerprint.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..layout import KVGroup, KVLayout
from .settings import KVTierSettings

log = logging.getLogger(__name__)


def worker_layout(config: Any, kv_caches: Any, settings: KVTierSettings
                  ) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    """(layout, tensors by layer name) for this worker from vLLM's config and canonical caches."""
    if len(kv_caches.group_data_refs) != len(config.groups):
        raise ValueError(f"vLLM registered {len(kv_caches.group_data_refs)} groups of KV tensors "
                         f"for {len(config.groups)} offloaded groups")
    windows = _sliding_windows()
    groups: list[KVGroup] = []
    tensors: dict[str, torch.Tensor] = {}
    for gc, refs in zip(config.groups, kv_caches.group_data_refs):
        pages = sorted({ref.page_size_bytes for ref in refs})
        if len(pages) != 1:
            raise ValueError(f"vLLM group {gc.group_id}: its layers have page sizes {pages} bytes; "
                             "allowed: one page size per group")
        if len(refs) == len(gc.layer_names):
            names = tuple(gc.layer_names)
        else:  # packed layouts: one transfer region per group, not one per layer
            names = tuple(f"group{gc.group_id}.region{i}" for i in range(len(refs)))
        for name, ref in zip(names, refs):
            tensors[name] = kv_caches.tensors[ref.tensor_idx].tensor
        group_windows = {windows.get(n) for n in gc.layer_names}
        window = group_windows.pop() if len(group_windows) == 1 else None
        groups.append(KVGroup(tokens_per_block=gc.tokens_per_block, page_bytes=pages[0],
                              layer_names=names, sliding_window=window))
    layout = KVLayout(
        groups=tuple(groups), blocks_per_chunk=config.cache.blocks_per_chunk,
        tokens_per_hash=config.cache.tokens_per_hash, model=settings.model or config.model.name,
        dtype=config.model.dtype, kv_layout=config.kv_cache_layout or "default",
        world_size=config.parallel.world_size, rank=config.parallel.rank)
    return layout, tensors


def _sliding_windows() -> dict[str, int]:
    """Sliding window per attention layer name, from the model vLLM is building (if it says)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
        vllm_config = get_current_vllm_config_or_none()
        layers = vllm_config.compilation_config.static_forward_context if vllm_config else {}
    except (ImportError, AttributeError):
        return {}
    out = {}
    for name, layer in layers.items():
        window = getattr(layer, "sliding_window", None)
        if isinstance(window, int) and window > 0:
            out[name] = window
    return out


def check_against_config(layout: KVLayout, config: Any) -> None:
    """Fail closed on a published layout that is not this engine's (a stale file, another model)."""
    expect = [gc.tokens_per_block for gc in config.groups]
    got = [gr.tokens_per_block for gr in layout.groups]
    if (got != expect or layout.tokens_per_hash != config.cache.tokens_per_hash
            or set(layout.blocks_per_chunk) != {config.cache.blocks_per_chunk}
            or layout.world_size != config.parallel.world_size):
        raise ValueError(
            f"published layout (tokens_per_block {got}, tokens_per_hash {layout.tokens_per_hash}, "
            f"blocks_per_chunk {layout.blocks_per_chunk}, world_size {layout.world_size}) is not "
            f"this engine's (tokens_per_block {expect}, tokens_per_hash "
            f"{config.cache.tokens_per_hash}, blocks_per_chunk {config.cache.blocks_per_chunk}, "
            f"world_size {config.parallel.world_size})")


def layout_path(settings: KVTierSettings, engine_id: str, rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)
    return Path(settings.layout_dir) / f"kvtier-vllm-{safe}-rank{rank}.json"


def publish(layout: KVLayout, path: Path) -> None:
    """Write the layout for the scheduler: temp name, then rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(layout.to_dict(), sort_keys=True))
    os.replace(tmp, path)


def read_published(path: Path) -> KVLayout | None:
    try:
        return KVLayout.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
