"""Paged KV caches for integration tests: scaled reference layouts, random blocks, poison, checks.

The oracle here reads every layer tensor as raw bytes of its storage, independently of the client's
copy code: block ``b`` of a layer is the ``page_bytes`` bytes starting at
``(storage_offset + b * stride(0)) * element_size``; every other byte of the storage belongs to no
page and must never be written by a load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch

from kvtier_client import Chunk, KVGroup, KVLayout

LAYOUTS_DIR = Path(__file__).parent.parent / "data" / "layouts"
LAYOUT_FILES = sorted(LAYOUTS_DIR.glob("*.json"))
POISON = 0xAB


def load_layout(path: Path, *, page_bytes: int = 4096, layers_per_group: int = 2) -> KVLayout:
    """A reference layout with smaller pages and fewer layers; everything else as in the file.

    A group with per-layer pages keeps them per layer, scaled so that its largest page is
    ``page_bytes`` (the others keep their ratio to it, at least 1 byte, and stay unequal).
    """
    data = json.loads(path.read_text())
    for group in data["groups"]:
        pages = group["page_bytes"]
        group["layer_names"] = group["layer_names"][:layers_per_group]
        if isinstance(pages, list):
            top = max(pages)
            group["page_bytes"] = [max(1, page_bytes * p // top) for p in pages[:layers_per_group]]
        else:
            group["page_bytes"] = page_bytes
    return KVLayout.from_dict(data)


def layer_pages(layout: KVLayout, g: int) -> list[tuple[str, int]]:
    """(layer name, its page bytes) of group ``g``, in payload order."""
    group = layout.groups[g]
    return list(zip(group.layer_names, group.layer_page_bytes))


def simple_layout(*, page_bytes: int, layers: int = 2, tokens_per_block: int = 16,
                  blocks_per_chunk: int = 4, model: str = "itest", prefix: str = "l") -> KVLayout:
    return KVLayout(
        groups=[KVGroup(tokens_per_block=tokens_per_block, page_bytes=page_bytes,
                        layer_names=tuple(f"{prefix}{i}" for i in range(layers)))],
        blocks_per_chunk=blocks_per_chunk, tokens_per_hash=16, model=model, dtype="bfloat16")


def random_tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 150_000, (n,), generator=gen).tolist()


def blocks_needed(layout: KVLayout, n_tokens: int) -> list[int]:
    return [-(-n_tokens // gr.tokens_per_block) for gr in layout.groups]


def random_kv(layout: KVLayout, num_blocks: Sequence[int], gen: torch.Generator
              ) -> dict[str, torch.Tensor]:
    """One contiguous uint8 ``[num_blocks[g], page]`` tensor of random bytes per layer."""
    kv = {}
    for g in range(len(layout.groups)):
        for name, pb in layer_pages(layout, g):
            kv[name] = torch.randint(0, 256, (num_blocks[g], pb), dtype=torch.uint8, generator=gen)
    return kv


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes into every byte of ``t``'s storage (padding included)."""
    raw = raw_bytes(t)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole storage as a flat uint8 tensor (shares memory)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def page_range(t: torch.Tensor, block: int, page_bytes: int) -> tuple[int, int]:
    elem = t.element_size()
    start = (t.storage_offset() + block * t.stride(0)) * elem
    return start, start + page_bytes


def page(t: torch.Tensor, block: int, page_bytes: int) -> torch.Tensor:
    start, end = page_range(t, block, page_bytes)
    return raw_bytes(t)[start:end]


def poison(kv: dict[str, torch.Tensor]) -> None:
    for t in kv.values():
        raw_bytes(t).fill_(POISON)


def chunk_pages(layout: KVLayout, kv: dict[str, torch.Tensor], chunk: Chunk) -> list[torch.Tensor]:
    """A chunk's pages in payload order ([layer][block]), copied."""
    return [page(kv[name], b, pb).clone()
            for name, pb in layer_pages(layout, chunk.group) for b in chunk.block_ids]


def assert_chunk_equals(layout: KVLayout, kv: dict[str, torch.Tensor], chunk: Chunk,
                        expected: list[torch.Tensor], what: str = "") -> None:
    got = chunk_pages(layout, kv, chunk)
    names = [(n, b) for n in layout.groups[chunk.group].layer_names for b in chunk.block_ids]
    for (name, block), g, e in zip(names, got, expected, strict=True):
        if not torch.equal(g, e):
            bad = int((g != e).nonzero()[0])
            raise AssertionError(
                f"{what} group {chunk.group} chunk @token {chunk.token_start}: layer {name!r} "
                f"block {block} differs from the stored page first at byte {bad} "
                f"(got {int(g[bad]):#x}, expected {int(e[bad]):#x})")


def assert_chunk_poisoned(layout: KVLayout, kv: dict[str, torch.Tensor], chunk: Chunk,
                          what: str = "") -> None:
    for name, pb in layer_pages(layout, chunk.group):
        for b in chunk.block_ids:
            p = page(kv[name], b, pb)
            assert bool((p == POISON).all()), (
                f"{what} group {chunk.group} chunk @token {chunk.token_start}: layer {name!r} "
                f"block {b} was written although its load reported a miss")


def assert_untouched_outside(layout: KVLayout, kv: dict[str, torch.Tensor],
                             loaded: Iterable[Chunk]) -> None:
    """Every byte of every layer's storage outside the loaded chunks' pages is still poison."""
    written: dict[str, torch.Tensor] = {n: torch.zeros(raw_bytes(t).shape, dtype=torch.bool)
                                        for n, t in kv.items()}
    for chunk in loaded:
        for name, pb in layer_pages(layout, chunk.group):
            for b in chunk.block_ids:
                start, end = page_range(kv[name], b, pb)
                written[name][start:end] = True
    for name, t in kv.items():
        outside = raw_bytes(t)[~written[name]]
        if not bool((outside == POISON).all()):
            pos = int((~written[name]).nonzero().flatten()[int((outside != POISON).nonzero()[0])])
            raise AssertionError(f"layer {name!r}: byte {pos} of its storage is outside every "
                                 "loaded page but was overwritten")
