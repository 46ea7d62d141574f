"""Gather/scatter between the paged KV cache and a staging buffer: the torch reference.

This is what CPU-only workers run and what the GPU kernels are checked against byte for byte, so it
is written for clarity with the kernels' batch semantics:

* a batch is a list of ``CopyUnit`` (one chunk: its group, its block ids, its staging offset);
* a unit's staging bytes are ``[layer][block][page]`` for the layers of its group, in the
  group's layer order (the chunk payload of DESIGN.md), each layer with its own page size (a group
  may mix page sizes, e.g. MLA latents and indexer caches), so layer ``l`` starts
  ``blocks * sum(pages of layers < l)`` bytes into the unit;
* block id -1 is skipped (its staging bytes are left as they are);
* each layer's tensor is read as raw bytes: block ``b`` is the ``page_bytes`` bytes starting at
  ``b * stride(0)`` elements from the tensor's start, whatever its dtype, shape or padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import KVLayout


@dataclass(frozen=True)
class CopyUnit:
    group: int
    block_ids: tuple[int, ...]
    staging_offset: int


@dataclass(frozen=True)
class LayerPages:
    """One layer's blocks as a ``[num_blocks, page_bytes]`` uint8 view of its storage."""

    name: str
    pages: torch.Tensor


def page_view(name: str, tensor: torch.Tensor, page_bytes: int, group: int) -> LayerPages:
    """Validate ``tensor`` as a paged KV cache of ``page_bytes`` pages; return its byte pages."""
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(f"group {group} layer {name!r}: tensor shape {tuple(tensor.shape)} has no "
                         "block dimension; allowed: first dim = number of blocks (>= 1)")
    elem = tensor.element_size()
    block_bytes = tensor[0].numel() * elem
    if block_bytes < page_bytes:
        raise ValueError(f"group {group} layer {name!r}: a block has {block_bytes} bytes, smaller "
                         f"than page_bytes={page_bytes}; allowed: page_bytes <= {block_bytes}")
    stride_bytes = tensor.stride(0) * elem
    num_blocks = tensor.shape[0]
    if num_blocks > 1 and stride_bytes < page_bytes:
        raise ValueError(f"group {group} layer {name!r}: block stride {stride_bytes} bytes is "
                         f"smaller than page_bytes={page_bytes}; pages would overlap")
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * elem
    end = start + (num_blocks - 1) * stride_bytes + page_bytes
    if end > storage.nbytes():
        raise ValueError(f"group {group} layer {name!r}: the last page ends at byte {end}, past "
                         f"its storage ({storage.nbytes()} bytes)")
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,))
    pages = raw.as_strided((num_blocks, page_bytes), (stride_bytes, 1), start)
    return LayerPages(name, pages)


def build_page_tables(layout: KVLayout, kv_caches: dict[str, torch.Tensor]) -> list[list[LayerPages]]:
    """Per group, its layers' byte pages, in the group's layer order."""
    tables = []
    for g, group in enumerate(layout.groups):
        layers = []
        for name, page_bytes in zip(group.layer_names, group.layer_page_bytes):
            if name not in kv_caches:
                raise ValueError(f"group {g}: layer {name!r} is missing from kv_caches; "
                                 f"allowed: a dict with every layer of the layout")
            layers.append(page_view(name, kv_caches[name], page_bytes, g))
        tables.append(layers)
    return tables


def _unit_layers(tables: list[list[LayerPages]], unit: CopyUnit, staging: torch.Tensor):
    """For each layer of the unit's group: (its staging ``[block][page]`` view, its pages,
    positions of the unit's valid blocks, their block ids, whether all blocks are valid)."""
    blocks = len(unit.block_ids)
    ids = torch.tensor(unit.block_ids, dtype=torch.long, device=staging.device)
    positions = torch.nonzero(ids != -1).flatten()
    complete = len(positions) == blocks
    valid_ids = ids if complete else ids[positions]
    offset = unit.staging_offset
    for layer in tables[unit.group]:
        page_bytes = layer.pages.shape[1]
        view = staging[offset: offset + blocks * page_bytes].view(blocks, page_bytes)
        offset += blocks * page_bytes
        yield view, layer.pages, positions, valid_ids, complete


def gather(tables: list[list[LayerPages]], units: list[CopyUnit], staging: torch.Tensor) -> None:
    """Copy every unit's pages from the KV cache into its staging range."""
    for unit in units:
        for view, pages, positions, ids, complete in _unit_layers(tables, unit, staging):
            if complete:  # no -1: one copy straight into staging
                torch.index_select(pages, 0, ids, out=view)
            else:
                view.index_copy_(0, positions, pages.index_select(0, ids))


def scatter(tables: list[list[LayerPages]], units: list[CopyUnit], staging: torch.Tensor) -> None:
    """Copy every unit's staging range back into its blocks of the KV cache."""
    for unit in units:
        for view, pages, positions, ids, complete in _unit_layers(tables, unit, staging):
            pages.index_copy_(0, ids, view if complete else view.index_select(0, positions))
