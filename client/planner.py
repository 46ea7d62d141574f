"""Split a request's tokens and per-group block ids into offload chunks.

Each group is chunked with its own `tokens_per_chunk[g]`: DeepSeek-V4-Flash has groups of 256, 64, 64,
4 and 8 tokens per block, so one chunk of 2 blocks spans 512 tokens in one group and 8 in another.
Chunking every group by one model-wide block size was silently wrong (vLLM PR #48878); here nothing
is derived from a single block size.

A chunk is planned only when it is complete (a trailing partial chunk is not stored) and all of its
blocks are present (block id -1 marks a block the engine does not hold, e.g. one a sliding window
freed; in a recurrent-state group block id 0 is vLLM's null block too, where align mode points the
states it no longer keeps). Each group keeps what a later load can use, as vLLM's offloading counts
it (`sliding_window_size_in_chunks`): the chunks overlapping a sliding window, the
`ceil(chunk size / tokens_per_chunk)` chunks of chunked local attention, and only the last complete
chunk of a recurrent-state group, whose block is the state at the block's end (older states are
never read again, and in align mode they are not even there).

A chunk's key is the group index (2 bytes, big-endian) followed by the prefix hash at the chunk's
last token, so equal prefixes give equal keys in every process, and the groups never share a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .hashing import prefix_hashes

if TYPE_CHECKING:
    from .layout import KVGroup, KVLayout

# Block id the engine uses for "no block here"; a chunk containing one is not planned.
MISSING_BLOCK = -1
# vLLM's null block: in a recurrent-state group, where align mode points the states it dropped.
NULL_BLOCK = 0


@dataclass(frozen=True)
class Chunk:
    """One offload unit: `blocks_per_chunk[group]` consecutive blocks of one group."""

    key: bytes  # group.to_bytes(2, "big") + 16-byte prefix hash at the chunk's last token (18 bytes)
    group: int  # index of the KV-cache group in the layout
    block_ids: tuple[int, ...]  # engine block ids of the chunk, in token order
    token_start: int  # first token covered (inclusive)
    token_end: int  # end of the tokens covered (exclusive)
    nbytes: int  # payload bytes: blocks_per_chunk * the sum of the group's per-layer page bytes
    # For KV events (the daemon announces stored chunks to KV-aware routers): the engine's block
    # hashes the chunk covers, in token order, and the hash before its first block (None at the
    # start of a prompt). Sent as PUT's ``blocks`` field only when the daemon publishes events.
    hashes: tuple[bytes, ...] = field(default=(), compare=False)
    parent: bytes | None = field(default=None, compare=False)


def window_chunks(group: KVGroup, tokens_per_chunk: int) -> int | None:
    """How many trailing chunks of `group` a later load can use; None: every chunk.

    vLLM's `get_sliding_window_size_in_chunks` (offloading scheduler) without speculative
    decoding's extra retained tokens: a sliding window needs `ceil(window / tokens_per_chunk)`
    chunks, chunked local attention `ceil(attention chunk / tokens_per_chunk)` (it never reaches
    back past one attention chunk), a recurrent state one.
    """
    if group.is_state:
        return 1
    if group.sliding_window is None:
        return None
    return -(-group.sliding_window // tokens_per_chunk)


def plan(
    layout: KVLayout,
    token_ids: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    trim_sliding_window: bool = True,
) -> list[Chunk]:
    """Chunks to offload for one request, ordered by group, then token_start.

    `block_ids[g][i]` is the block of group g holding tokens `[i*tpb, (i+1)*tpb)`. With
    `trim_sliding_window`, a sliding-window or chunked-local group keeps only its last
    `window_chunks` chunks before the end of its last complete chunk (for a sliding window: those
    overlapping its last `sliding_window` tokens): older ones are never read again by a load that
    resumes at that point. A recurrent-state group always keeps only its last complete chunk: an
    older state under a valid prefix key would be garbage for a reader in align mode.
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
        window = window_chunks(group, tpc)
        first = 0
        if window is not None and (trim_sliding_window or group.is_state):
            first = max(0, n_chunks - window)
        missing = (MISSING_BLOCK, NULL_BLOCK) if group.is_state else (MISSING_BLOCK,)
        prefix = g.to_bytes(2, "big")
        nbytes = layout.chunk_nbytes(g)
        for c in range(first, n_chunks):
            blocks = tuple(block_ids[g][c * bpc : (c + 1) * bpc])
            if any(b in missing for b in blocks):
                continue
            if min(blocks) < 0:
                raise ValueError(f"group {g}: block id {min(blocks)} in chunk {c}; "
                                 "allowed: ids >= 0, or -1 for a missing block")
            end = (c + 1) * tpc
            first_hash, last_hash = c * tpc // layout.tokens_per_hash, end // layout.tokens_per_hash
            key = prefix + hashes[last_hash - 1]
            chunks.append(Chunk(key, g, blocks, c * tpc, end, nbytes,
                                tuple(hashes[first_hash:last_hash]),
                                hashes[first_hash - 1] if first_hash else None))
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
