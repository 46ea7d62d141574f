"""vLLM's group configuration -> ``KVLayout``, and the layout file a worker publishes.

Worker side: each offloaded group of vLLM's ``OffloadingConfig`` becomes one ``KVGroup`` with the
group's own ``tokens_per_block``, the kind and window of its ``KVCacheSpec`` and the real
(unpadded) page bytes of each layer, checked against the registered tensors;
``blocks_per_chunk`` and ``tokens_per_hash`` are vLLM's; TP rank and world size come from its
parallel config. The fingerprint therefore guards every chunk against any other geometry.

Scheduler side: the scheduler never sees the KV tensors, so it cannot know the page bytes; it reads
the layout each worker rank published (a small JSON file per engine and rank, written atomically)
and asks the daemon under exactly that namespace and fingerprint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..layout import KVGroup, KVLayout
from .settings import KVTierSettings
from .specs import translate

log = logging.getLogger(__name__)


def worker_layout(config: Any, kv_caches: Any, settings: KVTierSettings,
                  kv_cache_config: Any) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    """(layout, tensors by layer name) for this worker from vLLM's config, specs and caches.

    Kind, window and page bytes per layer come from the group's ``KVCacheSpec`` in
    ``kv_cache_config`` (see ``specs``); the registered tensors must agree with them. In a packed
    (block-outermost) layout vLLM registers one tensor whose block holds every layer: each group
    then moves whole blocks as one region, and ``kv_layout`` says so in the fingerprint.
    """
    refs_by_group = kv_caches.group_data_refs
    if len(refs_by_group) != len(config.groups):
        raise ValueError(f"vLLM registered {len(refs_by_group)} groups of KV tensors "
                         f"for {len(config.groups)} offloaded groups")
    packed = _is_packed(config, kv_caches)
    groups: list[KVGroup] = []
    tensors: dict[str, torch.Tensor] = {}
    for gc, refs in zip(config.groups, refs_by_group):
        names = tuple(gc.layer_names)
        spec = translate(gc.group_id, kv_cache_config.kv_cache_groups[gc.group_id].kv_cache_spec,
                         names)
        if packed:
            names, pages = (f"group{gc.group_id}.packed",), refs[0].page_size_bytes
        else:
            pages = _layer_pages(gc.group_id, names, refs, spec.layer_page_bytes)
        for name, ref in zip(names, refs):
            tensors[name] = kv_caches.tensors[ref.tensor_idx].tensor
        groups.append(KVGroup(tokens_per_block=gc.tokens_per_block, page_bytes=pages,
                              layer_names=names, sliding_window=spec.sliding_window,
                              kind=spec.kind))
    kv_layout = config.kv_cache_layout or "default"
    layout = KVLayout(
        groups=tuple(groups), blocks_per_chunk=config.cache.blocks_per_chunk,
        tokens_per_hash=config.cache.tokens_per_hash, model=settings.model or config.model.name,
        dtype=config.model.dtype, kv_layout=f"{kv_layout}+packed" if packed else kv_layout,
        world_size=config.parallel.world_size, rank=config.parallel.rank)
    check_windows(layout, [vllm_window_chunks(gc, kv_cache_config, config.cache.blocks_per_chunk)
                           for gc in config.groups])
    return layout, tensors


def _is_packed(config: Any, kv_caches: Any) -> bool:
    """vLLM's packed layout: one tensor, one whole-block region per group (not one per layer)."""
    refs_by_group = kv_caches.group_data_refs
    return (len(kv_caches.tensors) == 1 and all(len(refs) == 1 for refs in refs_by_group)
            and any(len(gc.layer_names) > 1 for gc in config.groups))


def _layer_pages(group_id: int, names: tuple[str, ...], refs: Any,
                 expected: tuple[int, ...]) -> int | tuple[int, ...]:
    """The group's page bytes: one int, or one per layer when vLLM's layers differ."""
    got = tuple(ref.page_size_bytes for ref in refs)
    if len(got) != len(names) or got != expected:
        raise ValueError(f"vLLM group {group_id}: registered pages {list(got)} bytes for layers "
                         f"{list(names)}, but its KV cache specs say {list(expected)}; allowed: "
                         "one region per layer with the spec's page size")
    return got[0] if len(set(got)) == 1 else got


def vllm_window_chunks(gc: Any, kv_cache_config: Any, blocks_per_chunk: int) -> int | None:
    """Chunks vLLM keeps of group ``gc`` for one request (None: every chunk).

    vLLM 0.33 puts it in the group config (``sliding_window_size_in_chunks``); 0.32 computes it in
    its offloading scheduler with the same function, which is asked here.
    """
    if hasattr(gc, "sliding_window_size_in_chunks"):
        return gc.sliding_window_size_in_chunks
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        get_sliding_window_size_in_chunks,
    )
    spec = kv_cache_config.kv_cache_groups[gc.group_id].kv_cache_spec
    first = next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec
    return get_sliding_window_size_in_chunks(first, gc.tokens_per_block * blocks_per_chunk)


def check_windows(layout: KVLayout, vllm_windows: list[int | None]) -> None:
    """Fail closed unless kvtierd's planner keeps, per group, the chunks vLLM keeps.

    The fingerprint names each group's kind and window; if kvtierd's own plan for that geometry
    kept other chunks than vLLM loads, the published layout would describe a cache vLLM does not
    have. The check plans one long synthetic request and counts the chunks kept per group.
    """
    ours = planned_window_chunks(layout, vllm_windows)
    for g, (mine, theirs) in enumerate(zip(ours, vllm_windows)):
        if layout.offloadable[g] and mine != theirs:
            group = layout.groups[g]
            raise ValueError(
                f"group {g} ({group.kind}, window {group.sliding_window}, "
                f"{layout.tokens_per_chunk[g]} tokens per chunk): vLLM keeps "
                f"{'every chunk' if theirs is None else f'{theirs} chunk(s)'} per request, "
                f"kvtierd's plan keeps {'every chunk' if mine is None else f'{mine} chunk(s)'}; "
                "allowed: the same window (is the window extended, e.g. for speculative decoding?)")


def planned_window_chunks(layout: KVLayout, windows: list[int | None]) -> list[int | None]:
    """Per group, how many trailing chunks ``layout.plan`` keeps (None: all of them)."""
    tpc = [t for t, ok in zip(layout.tokens_per_chunk, layout.offloadable) if ok]
    if not tpc:
        return [None] * len(layout.groups)
    unit = math.lcm(layout.tokens_per_hash, *tpc)
    # enough tokens that every group has more chunks than any window asked about, plus two
    need = max([(w or 0) + 2 for w in windows] + [2])
    n_tokens = unit * max(-(-need * t // unit) for t in tpc)
    blocks = [list(range(1, n_tokens // gr.tokens_per_block + 2)) for gr in layout.groups]
    kept = [0] * len(layout.groups)
    for chunk in layout.plan([i % 997 for i in range(n_tokens)], blocks):
        kept[chunk.group] += 1
    return [k if ok and k < n_tokens // t else None
            for k, t, ok in zip(kept, layout.tokens_per_chunk, layout.offloadable)]


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
