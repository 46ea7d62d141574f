"""A vLLM transfer job as ``Chunk`` objects (no vLLM import: the mapping is unit-tested alone).

vLLM describes a job by its keys (one per chunk, in group order) and the engine's blocks: per group
``g``, ``group_sizes[g]`` block ids whose first one sits at logical block ``block_indices[g]`` of the
request. The blocks fill consecutive chunks of ``blocks_per_chunk[g]`` slots starting at slot
``block_indices[g] % blocks_per_chunk[g]`` (a chunk whose head a sliding window freed, or whose
head is already on the device); slots without a block are -1, so they are neither copied nor loaded.
vLLM's block 0 is its null block (a freed sliding-window block, an old Mamba state in align mode):
it never holds a request's KV, so it is a slot without a block too.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..layout import KVLayout
from ..planner import MISSING_BLOCK, Chunk

NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null block


def job_chunks(layout: KVLayout, keys: Sequence[bytes], block_ids: Sequence[int],
               group_sizes: Sequence[int], block_indices: Sequence[int]) -> list[Chunk]:
    if len(group_sizes) != len(layout.groups) or len(block_indices) != len(layout.groups):
        raise ValueError(f"job has {len(group_sizes)} group sizes and {len(block_indices)} block "
                         f"indices; allowed: one per group ({len(layout.groups)})")
    chunks: list[Chunk] = []
    pos = key_pos = 0
    for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
        if not size:
            continue
        bpc = layout.blocks_per_chunk[g]
        skip = first % bpc
        count = -(-(size + skip) // bpc)
        slots = [MISSING_BLOCK] * skip + [MISSING_BLOCK if b == NULL_BLOCK else int(b)
                                          for b in block_ids[pos:pos + size]]
        slots += [MISSING_BLOCK] * (count * bpc - len(slots))
        tpc = layout.tokens_per_chunk[g]
        start = (first - skip) // bpc  # the request's chunk index of the job's first chunk
        for c, key in enumerate(keys[key_pos:key_pos + count]):
            # vLLM's OffloadKey is the chunk's last block hash + its group (4 bytes): the hash
            # is what vLLM's own events name the chunk by (kvtierd announces it with it)
            chunks.append(Chunk(bytes(key), g, tuple(slots[c * bpc:(c + 1) * bpc]),
                                (start + c) * tpc, (start + c + 1) * tpc, layout.chunk_nbytes(g),
                                (bytes(key)[:-4],)))
        pos += size
        key_pos += count
    if pos != len(block_ids) or key_pos != len(keys):
        raise ValueError(f"job names {len(keys)} keys and {len(block_ids)} blocks, but its groups "
                         f"cover {key_pos} keys and {pos} blocks")
    return chunks


def neighbour_keys(chunks: list[Chunk]) -> list[Chunk]:
    """Test-only: each chunk takes the key of the next chunk of its group (the last, the previous).

    A group's only chunk in the job (a recurrent state keeps one) takes the key of the chunk at the
    same place in the next group with the same payload size, so that a hybrid model's negative
    control corrupts its state groups too, not only its attention.
    """
    out = []
    for i, chunk in enumerate(chunks):
        same = [j for j in (i + 1, i - 1) if 0 <= j < len(chunks) and chunks[j].group == chunk.group]
        if not same:
            same = [j for j, other in enumerate(chunks) if other.group != chunk.group
                    and other.nbytes == chunk.nbytes and other.token_end == chunk.token_end]
        key = chunks[same[0]].key if same else chunk.key
        out.append(Chunk(key, chunk.group, chunk.block_ids, chunk.token_start, chunk.token_end,
                         chunk.nbytes))
    return out
