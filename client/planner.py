"""Split a request's tokens and per-group block ids into offload chunks.

Each group is chunked with its own `tokens_per_chunk[g]`: DeepSeek-V4-Flash has groups of 256, 64, 64,
4 and 8 tokens per block, so one chunk of 2 blocks spans 512 tokens in one group and 8 in another.
Chunking every group by one model-wide block size was silently wrong (vLLM PR #48878); here nothing
is derived from a single block size.

A chunk is planned only when it is complete (a trailing partial chunk is not stored) and all of its
blocks are present (block id -1 marks a block the engine does not hold, e.g. one a sliding window
freed). Its key is the group index (2 bytes, big-endian) followed by the prefix hash at the chunk's
last token, so equal prefixes give equal keys in every process, and the groups never share a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .hashing import prefix_hashes

if TYPE_CHECKING:
    from .layout import KVLayout

# Block id the engine uses for "no block here"; a chunk containing one is not planned.
MISSING_BLOCK = -1


@dataclass(frozen=True)
class Chunk:
    """One offload unit: `blocks_per_chunk[group]` consecutive blocks of one group."""

    key: bytes  # group.to_bytes(2, "big") + 16-byte prefix hash at the chunk's last token (18 bytes)
    group: int  # index of the KV-cache group in the layout
    block_ids: tuple[int, ...]  # engine block ids of the chunk, in token order
    token_start: int  # first token covered (inclusive)
    token_end: int  # end of the tokens covered (exclusive)
    nbytes: int  # payload bytes: layers * blocks_per_chunk * page_bytes of the group


def plan(
    layout: KVLayout,
    token_ids: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    trim_sliding_window: bool = True,
) -> list[Chunk]:
    """Chunks to offload for one request, ordered by group, then token_start.

    `block_ids[g][i]` is the block of group g holding tokens `[i*tpb, (i+1)*tpb)`. With
    `trim_sliding_window`, a sliding-window group keeps only the chunks that overlap the last
    `sliding_window` tokens before the end of its last complete chunk: older ones are never read
    again by a load that resumes at that point.
    """
    _check_block_ids(layout, len(token_ids), block_ids)
    hashes = prefix_hashes(token_ids, layout.tokens_per_hash)
    chunks: list[Chunk] = []
    for g, group in enumerate(layout.groups):
        if not layout.offloadable[g]:
            continue
        tpc = layout.tokens_per_chunk[g]
        bpc = layout.blocks_per_chunk[g]
        n_chunks = len(token_ids) // tpc
        first = 0
        if trim_sliding_window and group.sliding_window is not None:
            # smallest c with (c + 1) * tpc > end - window
            first = max(0, (n_chunks * tpc - group.sliding_window) // tpc)
        prefix = g.to_bytes(2, "big")
        nbytes = layout.chunk_nbytes(g)
        for c in range(first, n_chunks):
            blocks = tuple(block_ids[g][c * bpc : (c + 1) * bpc])
            if MISSING_BLOCK in blocks:
                continue
            if min(blocks) < 0:
                raise ValueError(f"group {g}: block id {min(blocks)} in chunk {c}; "
                                 "allowed: ids >= 0, or -1 for a missing block")
            end = (c + 1) * tpc
            key = prefix + hashes[end // layout.tokens_per_hash - 1]
            chunks.append(Chunk(key, g, blocks, c * tpc, end, nbytes))
    return chunks


def _check_block_ids(layout: KVLayout, n_tokens: int, block_ids: Sequence[Sequence[int]]) -> None:
    """Fail closed on a block table that does not match the layout or does not cover the tokens."""
    if len(block_ids) != len(layout.groups):
        raise ValueError(
            f"block_ids has {len(block_ids)} lists, expected exactly one per group ({len(layout.groups)})"
        )
    for g, group in enumerate(layout.groups):
        need = -(-n_tokens // group.tokens_per_block)
        if len(block_ids[g]) < need:
            raise ValueError(
                f"group {g}: block_ids[{g}] has {len(block_ids[g])} blocks, but {n_tokens} tokens at "
                f"tokens_per_block={group.tokens_per_block} need at least {need}"
            )
