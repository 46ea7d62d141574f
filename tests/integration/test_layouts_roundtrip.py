"""Every reference layout round trips through a real daemon, byte for byte, into other blocks.

Keys depend only on the tokens, so a second block table planned from the same tokens names the same
chunks: storing from table A and loading into table B proves the copies follow the block ids (and
each group's own tokens_per_block and blocks_per_chunk), not the positions they were stored from.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

import pytest
import torch
from helpers.kv import (
    LAYOUT_FILES,
    assert_chunk_equals,
    assert_untouched_outside,
    blocks_needed,
    chunk_pages,
    fill_random,
    load_layout,
    poison,
    random_tokens,
    simple_layout,
)

from kvtier_client import KVGroup, KVLayout, KVTierClient

pytestmark = pytest.mark.timeout(60)

REMAINDER = 37  # a trailing partial chunk in every group (37 is a multiple of no tokens_per_block)


def two_tables(need: list[int]) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Block counts and two disjoint tables: A = 0..n-1 in order, B = the top n blocks reversed."""
    num_blocks = [2 * n + 3 for n in need]
    table_a = [list(range(n)) for n in need]
    table_b = [[total - 1 - i for i in range(n)] for n, total in zip(need, num_blocks)]
    return num_blocks, table_a, table_b


@pytest.mark.parametrize("page_bytes", [4100, 4096])
@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_reference_layout_round_trips_into_other_blocks(daemon, path, page_bytes):
    layout = load_layout(path, page_bytes=page_bytes, layers_per_group=2)
    raw = json.loads(path.read_text())  # the oracle: straight from the file, not the layout object
    bpc = raw["blocks_per_chunk"]
    bpc = bpc if isinstance(bpc, list) else [bpc] * len(raw["groups"])
    file_tpc = [gr["tokens_per_block"] * n for gr, n in zip(raw["groups"], bpc)]
    file_offloadable = [gr["tokens_per_block"] % raw["tokens_per_hash"] == 0
                        for gr in raw["groups"]]
    assert list(layout.tokens_per_chunk) == file_tpc
    assert list(layout.offloadable) == file_offloadable
    gen = torch.Generator().manual_seed(zlib.crc32(f"{path.stem}/{page_bytes}".encode()))
    tpc = layout.tokens_per_chunk
    offloadable = [g for g, ok in enumerate(layout.offloadable) if ok]
    n_tokens = 3 * max(tpc[g] for g in offloadable) + REMAINDER
    tokens = random_tokens(gen, n_tokens)
    num_blocks, table_a, table_b = two_tables(blocks_needed(layout, n_tokens))
    kv = {}
    for g, group in enumerate(layout.groups):
        for name, page in zip(group.layer_names, group.layer_page_bytes):
            kv[name] = torch.empty((num_blocks[g], page), dtype=torch.uint8)
            fill_random(kv[name], gen)

    chunks_a = layout.plan(tokens, table_a, trim_sliding_window=False)
    chunks_b = layout.plan(tokens, table_b, trim_sliding_window=False)

    # The plan: per-group counts from each group's own tokens_per_chunk; skipped groups get none;
    # a recurrent-state group only its last complete chunk.
    for g in range(len(layout.groups)):
        count = sum(c.group == g for c in chunks_a)
        if file_offloadable[g]:
            complete = n_tokens // file_tpc[g]
            first = complete - 1 if raw["groups"][g]["kind"] == "mamba" else 0
            assert complete >= 2 and count == complete - first, (g, count)
            spans = [(c.token_start, c.token_end) for c in chunks_a if c.group == g]
            assert spans == [(i * file_tpc[g], (i + 1) * file_tpc[g]) for i in range(first, complete)]
        else:
            assert count == 0, f"group {g} is not offloadable but got {count} chunks"
    assert [(c.key, c.group, c.token_start) for c in chunks_a] == \
        [(c.key, c.group, c.token_start) for c in chunks_b]
    assert len({c.key for c in chunks_a}) == len(chunks_a), "two chunks share a key"
    for a, b in zip(chunks_a, chunks_b):
        assert set(a.block_ids).isdisjoint(b.block_ids)
        assert a.nbytes == b.nbytes == layout.chunk_nbytes(a.group)

    expected = [chunk_pages(layout, kv, c) for c in chunks_a]
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert client.lookup(chunks_b) == [False] * len(chunks_b)
        assert client.store(chunks_a).result(timeout=30) == [True] * len(chunks_a)
        cpu = daemon.cpu()
        assert cpu["chunks"] == len(chunks_a) and cpu["pending_chunks"] == 0
        assert client.lookup(chunks_b) == [True] * len(chunks_b)

        poison(kv)
        assert client.load(chunks_b).result(timeout=30) == [True] * len(chunks_b)
        for chunk, pages in zip(chunks_b, expected):
            assert_chunk_equals(layout, kv, chunk, pages, path.stem)
        # Nothing else was written: not table A, not the spare blocks, not other groups' blocks.
        assert_untouched_outside(layout, kv, chunks_b)

        # A sliding-window plan (the default) is a subset of what was stored: it loads too.
        trimmed = layout.plan(tokens, table_b)
        assert {c.key for c in trimmed} <= {c.key for c in chunks_b}
        for g, group in enumerate(layout.groups):
            if not layout.offloadable[g]:
                continue
            kept = [c for c in chunks_b if c.group == g and c in trimmed]
            if group.is_state:
                assert kept == [c for c in chunks_b if c.group == g] and len(kept) == 1
            elif group.sliding_window is None:
                assert len(kept) == n_tokens // tpc[g]
            else:
                end = (n_tokens // tpc[g]) * tpc[g]
                overlapping = [c for c in chunks_b
                               if c.group == g and c.token_end > end - group.sliding_window]
                assert kept == overlapping, f"group {g}: trimmed plan keeps the wrong chunks"
        poison(kv)
        assert all(client.load(trimmed).result(timeout=30))
        by_key = {c.key: pages for c, pages in zip(chunks_b, expected)}
        for chunk in trimmed:
            assert_chunk_equals(layout, kv, chunk, by_key[chunk.key], f"{path.stem} trimmed")

        assert client.delete(chunks_b) == [True] * len(chunks_b)
        assert client.lookup(chunks_a) == [False] * len(chunks_a)
        assert daemon.cpu()["chunks"] == 0
        poison(kv)
        assert client.load(chunks_b).result(timeout=30) == [False] * len(chunks_b)
        assert_untouched_outside(layout, kv, [])
    daemon.check()


def test_strided_padded_and_bfloat16_tensors_round_trip(daemon):
    """Pages are the first page_bytes of each block, wherever stride(0) and the dtype put it."""
    page_bytes = 4100
    layout = simple_layout(page_bytes=page_bytes, layers=4, tokens_per_block=16,
                           blocks_per_chunk=16, model="strided")
    gen = torch.Generator().manual_seed(7)
    n_tokens = 2 * 256 + 100
    num_blocks, table_a, table_b = two_tables(blocks_needed(layout, n_tokens))
    n = num_blocks[0]
    pad = 60
    bases = {
        "l0": torch.empty((n, page_bytes), dtype=torch.uint8),  # contiguous, exact pages
        # stride(0) = 2 * (page_bytes + pad) > page_bytes: K half of a [blocks, 2, X] cache
        "l1": torch.empty((n, 2, page_bytes + pad), dtype=torch.uint8),
        # bfloat16 blocks with 8 padding bytes each: only the first page_bytes are copied
        "l2": torch.empty((n, page_bytes // 2 + 4), dtype=torch.bfloat16),
        # V half (storage_offset > 0) of a bfloat16 [blocks, 2, X] cache
        "l3": torch.empty((n, 2, page_bytes // 2 + 16), dtype=torch.bfloat16),
    }
    kv = {"l0": bases["l0"], "l1": bases["l1"][:, 0], "l2": bases["l2"], "l3": bases["l3"][:, 1]}
    assert kv["l1"].stride(0) > page_bytes and not kv["l1"].is_contiguous()
    assert kv["l3"].storage_offset() > 0 and kv["l3"].dtype == torch.bfloat16
    for t in kv.values():
        fill_random(t, gen)  # the whole storage, so a misplaced copy reads non-poison bytes
    tokens = random_tokens(gen, n_tokens)
    chunks_a = layout.plan(tokens, table_a)
    chunks_b = layout.plan(tokens, table_b)
    assert len(chunks_a) == 2 and chunks_a[0].nbytes > 256 * 1024  # copied on a daemon thread
    expected = [chunk_pages(layout, kv, c) for c in chunks_a]

    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert client.store(chunks_a).result(timeout=30) == [True, True]
        poison(kv)
        assert client.load(chunks_b).result(timeout=30) == [True, True]
    for chunk, pages in zip(chunks_b, expected):
        assert_chunk_equals(layout, kv, chunk, pages, "strided")
    # padding bytes, the other half of l1/l3 and every other block stay poison
    assert_untouched_outside(layout, kv, chunks_b)
    daemon.check()


def test_per_layer_page_sizes_round_trip_with_padding_untouched(daemon):
    """One group whose layers have different page sizes (MLA latent + indexer cache, like
    DeepSeek-V3.2), in padded, strided and bfloat16 tensors: each layer's own page is copied."""
    pages = (4100, 824, 1000)
    layout = KVLayout(groups=[KVGroup(tokens_per_block=64, page_bytes=pages, kind="mla",
                                      layer_names=("attn.0", "indexer.0", "attn.1"))],
                      blocks_per_chunk=2, tokens_per_hash=64, model="per-layer", dtype="fp8_ds_mla")
    assert layout.chunk_nbytes(0) == 2 * sum(pages)
    gen = torch.Generator().manual_seed(32)
    n_tokens = 3 * 128 + 37
    num_blocks, table_a, table_b = two_tables(blocks_needed(layout, n_tokens))
    n = num_blocks[0]
    kv = {"attn.0": torch.empty((n, 2, 4100 + 12), dtype=torch.uint8)[:, 1],  # offset, strided
          "indexer.0": torch.empty((n, 824 + 40), dtype=torch.uint8),  # padding after each page
          "attn.1": torch.empty((n, 500 + 3), dtype=torch.bfloat16)}  # 1000 B of 1006 per block
    for t in kv.values():
        fill_random(t, gen)
    tokens = random_tokens(gen, n_tokens)
    chunks_a, chunks_b = layout.plan(tokens, table_a), layout.plan(tokens, table_b)
    assert len(chunks_a) == 3 and all(c.nbytes == 2 * sum(pages) for c in chunks_a)
    expected = [chunk_pages(layout, kv, c) for c in chunks_a]
    assert [len(p) for p in expected[0]] == [4100, 4100, 824, 824, 1000, 1000]

    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert client.store(chunks_a).result(timeout=30) == [True] * 3
        poison(kv)
        assert client.load(chunks_b).result(timeout=30) == [True] * 3
        for chunk, want in zip(chunks_b, expected):
            assert_chunk_equals(layout, kv, chunk, want, "per-layer")
        assert_untouched_outside(layout, kv, chunks_b)
        # the same geometry with one page one byte smaller is another layout: a miss, no bytes
        other = dataclasses.replace(layout.groups[0], page_bytes=(4100, 823, 1000))
        smaller = dataclasses.replace(layout, groups=(other,))
        assert smaller.fingerprint != layout.fingerprint
        with KVTierClient.connect(daemon.address, layout=smaller, kv_caches=kv) as reader:
            poison(kv)
            assert reader.load(smaller.plan(tokens, table_b)).result(timeout=30) == [False] * 3
            assert_untouched_outside(smaller, kv, [])
    daemon.check()
