"""Chunk planning and prefix hashing, checked against independent brute-force computations."""

import dataclasses
import json
import random
import struct
import time
from array import array
from pathlib import Path

import pytest
import xxhash

from kvtier_client import planner
from kvtier_client.hashing import ROOT_HASH, prefix_hashes
from kvtier_client.layout import KVGroup, KVLayout
from kvtier_client.planner import Chunk

LAYOUT_DIR = Path(__file__).parents[2] / "data" / "layouts"
LAYOUT_FILES = sorted(LAYOUT_DIR.glob("*.json"))


def load(name: str) -> KVLayout:
    return KVLayout.from_dict(json.loads((LAYOUT_DIR / f"{name}.json").read_text()))


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(n)]


def block_table(layout: KVLayout, n_tokens: int, extra: int = 0) -> list[list[int]]:
    """Distinct ids per group so that a wrong slice or a wrong group cannot pass unnoticed."""
    return [list(range(g * 1_000_000, g * 1_000_000 + -(-n_tokens // gr.tokens_per_block) + extra))
            for g, gr in enumerate(layout.groups)]


def complete_ranges(n_tokens: int, tpc: int) -> list[tuple[int, int]]:
    return [(s, s + tpc) for s in range(0, n_tokens - tpc + 1, tpc)]


def reference_hashes(toks: list[int], unit: int) -> list[bytes]:
    """The documented chain, written out independently of the module."""
    out, parent = [], ROOT_HASH
    for i in range(len(toks) // unit):
        payload = b"".join(struct.pack("<q", t) for t in toks[i * unit:(i + 1) * unit])
        parent = xxhash.xxh3_128_digest(parent + payload)
        out.append(parent)
    return out


def by_group(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    out: dict[int, list[Chunk]] = {}
    for c in chunks:
        out.setdefault(c.group, []).append(c)
    return out


# -- hashing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("unit", [1, 4, 16, 64])
def test_prefix_hashes_match_reference_chain(unit):
    toks = tokens(1000, seed=unit) + [-1, 2**63 - 1, -(2**63)]
    got = prefix_hashes(toks, unit)
    assert got == reference_hashes(toks, unit)
    assert len(got) == len(toks) // unit and all(len(h) == 16 for h in got)


def test_prefix_hashes_only_complete_units_and_prefix_property():
    toks = tokens(100)
    full = prefix_hashes(toks, 16)
    assert len(full) == 6
    assert prefix_hashes(toks[:95], 16) == full[:5]
    assert prefix_hashes(toks[:15], 16) == []
    changed = list(toks)
    changed[40] += 1  # in unit 2
    other = prefix_hashes(changed, 16)
    assert other[:2] == full[:2]
    assert all(a != b for a, b in zip(other[2:], full[2:]))


def test_prefix_hashes_same_for_any_int_sequence():
    toks = tokens(64)
    expected = prefix_hashes(toks, 8)
    assert prefix_hashes(tuple(toks), 8) == expected
    assert prefix_hashes(array("q", toks), 8) == expected
    assert prefix_hashes(range(64), 8) == prefix_hashes(list(range(64)), 8)


def test_prefix_hashes_rejects_bad_input():
    with pytest.raises(ValueError, match=r"tokens_per_hash=0"):
        prefix_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="int64"):
        prefix_hashes([2**63], 1)


def test_prefix_hashes_fast_for_100k_tokens():
    toks = tokens(100_000)
    start = time.perf_counter()
    assert len(prefix_hashes(toks, 4)) == 25_000
    assert time.perf_counter() - start < 2.0


# -- chunk counts, slices, sizes --------------------------------------------------------------------


def _lengths(layout: KVLayout) -> list[int]:
    rng = random.Random(layout.fingerprint)
    out = {0, 1}
    for tpc in layout.tokens_per_chunk:
        if tpc:
            out |= {tpc - 1, tpc, tpc + 1, 3 * tpc}
    return sorted(out | {rng.randint(1, 5000) for _ in range(4)})


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_chunk_counts_slices_and_sizes_without_trimming(path):
    layout = KVLayout.from_dict(json.loads(path.read_text()))
    for n in _lengths(layout):
        toks = tokens(n, seed=n)
        table = block_table(layout, n)
        groups = by_group(layout.plan(toks, table, trim_sliding_window=False))
        for g, group in enumerate(layout.groups):
            got = groups.get(g, [])
            if not layout.offloadable[g]:
                assert got == []
                continue
            tpc, tpb = layout.tokens_per_chunk[g], group.tokens_per_block
            expected = complete_ranges(n, tpc)
            if group.is_state:  # only the last state is usable, and block id 0 is the null block
                expected = [(st, e) for st, e in expected[-1:]
                            if 0 not in table[g][st // tpb:e // tpb]]
            assert [(c.token_start, c.token_end) for c in got] == expected, (path.stem, g, n)
            for c in got:
                assert c.block_ids == tuple(table[g][c.token_start // tpb:c.token_end // tpb])
                assert len(c.block_ids) == layout.blocks_per_chunk[g]
                assert c.nbytes == layout.chunk_nbytes(g)


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_chunks_ordered_by_group_then_token_start(path):
    layout = KVLayout.from_dict(json.loads(path.read_text()))
    n = 3 * max(layout.tokens_per_chunk) + 7
    chunks = layout.plan(tokens(n), block_table(layout, n), trim_sliding_window=False)
    order = [(c.group, c.token_start) for c in chunks]
    assert order == sorted(order) and len(set(order)) == len(order) > 0


def test_skipped_group_gets_no_chunks_and_is_reported():
    layout = load("hash-misaligned")
    n = 4096
    chunks = layout.plan(tokens(n), block_table(layout, n), trim_sliding_window=False)
    assert [g for g, _ in layout.skipped_groups] == [1]
    assert {c.group for c in chunks} == {0, 2}
    assert len(by_group(chunks)[0]) == n // 256 and len(by_group(chunks)[2]) == n // 64


def test_pr48878_deepseek_v4_flash_chunks_each_group_with_its_own_block_size():
    layout = load("deepseek-v4-flash")  # blocks_per_chunk=2, tokens_per_block 256/64/64/4/8
    n = 1000
    table = block_table(layout, n)
    counts = {g: len(cs) for g, cs in by_group(layout.plan(tokens(n), table, trim_sliding_window=False)).items()}
    assert counts == {0: 1, 1: 7, 2: 7, 3: 125, 4: 62}
    trimmed = by_group(layout.plan(tokens(n), table))
    # sliding groups (window 128): last complete chunk ends at 896, keep chunks ending after 768
    assert [(c.token_start, c.token_end) for c in trimmed[1]] == [(768, 896)]
    assert [(c.token_start, c.token_end) for c in trimmed[2]] == [(768, 896)]
    assert trimmed[3][-1].block_ids == (table[3][248], table[3][249]) and trimmed[3][-1].token_end == 1000
    assert trimmed[4][-1].token_end == 992 and trimmed[4][-1].block_ids == (table[4][122], table[4][123])


# -- sliding-window trimming ------------------------------------------------------------------------


def brute_force_trim(n: int, tpc: int, window: int) -> list[tuple[int, int]]:
    ranges = complete_ranges(n, tpc)
    if not ranges:
        return []
    end = max(e for _, e in ranges)
    return [(s, e) for s, e in ranges if any(end - window <= t < end for t in range(s, e))]


def _windowed_layouts() -> list[KVLayout]:
    tiny = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("f",)),
                            KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("s",), sliding_window=40),
                            KVGroup(tokens_per_block=32, page_bytes=64, layer_names=("t",), sliding_window=64),
                            KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("u",), sliding_window=1)],
                    blocks_per_chunk=(2, 1, 1, 3), tokens_per_hash=16, model="tiny", dtype="bfloat16")
    return [load("gemma-4-31b"), load("deepseek-v4-flash"), tiny]


@pytest.mark.parametrize("layout", _windowed_layouts(), ids=lambda lay: lay.model)
def test_trimming_matches_brute_force(layout):
    rng = random.Random(7)
    for n in sorted({0, 1, 127, 128, 129, 1023, 1024, 1025, 2048, 4100} | {rng.randint(1, 5000) for _ in range(8)}):
        toks, table = tokens(n, seed=n), block_table(layout, n)
        trimmed = by_group(layout.plan(toks, table))
        untrimmed = by_group(layout.plan(toks, table, trim_sliding_window=False))
        for g, group in enumerate(layout.groups):
            tpc = layout.tokens_per_chunk[g]
            got = [(c.token_start, c.token_end) for c in trimmed.get(g, [])]
            if group.sliding_window is None:
                assert trimmed.get(g) == untrimmed.get(g)
            else:
                assert got == brute_force_trim(n, tpc, group.sliding_window), (layout.model, g, n)


def test_trimming_really_drops_chunks():
    layout = load("gemma-4-31b")  # window 1024, 128 tokens per chunk in sliding groups
    n = 4096
    trimmed = by_group(layout.plan(tokens(n), block_table(layout, n)))
    assert len(trimmed[0]) == 1024 // 128 and trimmed[0][0].token_start == 3072
    assert len(trimmed[5]) == n // 256  # full attention untouched


# -- missing blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "gemma-4-31b", "hash-misaligned"])
def test_missing_blocks_exclude_exactly_the_chunks_containing_them(name):
    layout = load(name)
    n = 3000
    rng = random.Random(name)
    table = block_table(layout, n, extra=5)
    missing = {g: set(rng.sample(range(len(ids)), max(1, len(ids) // 10))) for g, ids in enumerate(table)}
    for g, idx in missing.items():
        for i in idx:
            table[g][i] = -1
    groups = by_group(layout.plan(tokens(n), table, trim_sliding_window=False))
    dropped = 0
    for g, group in enumerate(layout.groups):
        if not layout.offloadable[g]:
            continue
        tpb, everything = group.tokens_per_block, complete_ranges(n, layout.tokens_per_chunk[g])
        expected = [(s, e) for s, e in everything if not missing[g] & set(range(s // tpb, e // tpb))]
        assert [(c.token_start, c.token_end) for c in groups.get(g, [])] == expected
        assert all(-1 not in c.block_ids for c in groups.get(g, []))
        dropped += len(everything) - len(expected)
    assert dropped > 0  # the case is not vacuous


def test_other_negative_block_id_is_an_error():
    layout = load("llama-3.1-8b")
    table = block_table(layout, 512)
    table[0][20] = -7
    with pytest.raises(ValueError, match=r"group 0: block id -7"):
        layout.plan(tokens(512), table)


# -- keys -------------------------------------------------------------------------------------------


def test_keys_are_group_plus_chain_hash_at_last_token():
    layout = load("deepseek-v4-flash")
    toks = tokens(1500)
    ref = reference_hashes(toks, layout.tokens_per_hash)
    chunks = layout.plan(toks, block_table(layout, 1500), trim_sliding_window=False)
    for c in chunks:
        assert len(c.key) == 18
        assert c.key == c.group.to_bytes(2, "big") + ref[c.token_end // layout.tokens_per_hash - 1]


def test_keys_follow_the_prefix_not_the_block_ids():
    layout = load("gemma-4-31b")
    toks = tokens(2048)
    a = {(c.group, c.token_end): c.key for c in layout.plan(toks, block_table(layout, 2048), False)}
    longer = toks + tokens(500, seed=99)
    b = {(c.group, c.token_end): c.key
         for c in layout.plan(longer, block_table(layout, len(longer), extra=3), False)}
    assert all(b[k] == key for k, key in a.items())
    changed = list(toks)
    changed[1000] ^= 1
    c = {(cc.group, cc.token_end): cc.key for cc in layout.plan(changed, block_table(layout, 2048), False)}
    for (g, end), key in a.items():
        assert (c[(g, end)] == key) == (end <= 1000), (g, end)


def test_keys_differ_between_groups_with_the_same_token_range():
    layout = load("gemma-4-31b")  # groups 0..4 share one geometry
    chunks = layout.plan(tokens(1024), block_table(layout, 1024), trim_sliding_window=False)
    same_range = [c for c in chunks if (c.token_start, c.token_end) == (0, 128)]
    assert len(same_range) == 5
    assert len({c.key for c in same_range}) == 5
    assert len({c.key[2:] for c in same_range}) == 1


def test_prefix_hashes_computed_once_per_plan(monkeypatch):
    calls = []

    def counting(toks, unit):
        calls.append(unit)
        return prefix_hashes(toks, unit)

    monkeypatch.setattr(planner, "prefix_hashes", counting)
    layout = load("deepseek-v4-flash")
    assert len({c.group for c in layout.plan(tokens(2000), block_table(layout, 2000))}) == 5
    assert calls == [layout.tokens_per_hash]


# -- block table validation -------------------------------------------------------------------------


def test_block_ids_must_have_one_list_per_group():
    layout = load("deepseek-v4-flash")
    table = block_table(layout, 100)
    with pytest.raises(ValueError, match=r"block_ids has 4 lists, expected exactly one per group \(5\)"):
        layout.plan(tokens(100), table[:4])
    with pytest.raises(ValueError, match=r"has 6 lists"):
        layout.plan(tokens(100), table + [[]])


@pytest.mark.parametrize("name, g", [("deepseek-v4-flash", 3), ("hash-misaligned", 1), ("gemma-4-31b", 5)])
def test_block_ids_must_cover_the_tokens_in_every_group(name, g):
    layout = load(name)
    n = 1001
    table = block_table(layout, n)
    need = len(table[g])
    table[g] = table[g][:-1]
    with pytest.raises(ValueError, match=rf"group {g}: block_ids\[{g}\] has {need - 1} blocks, .*{n} tokens.*"
                                         rf"at least {need}"):
        layout.plan(tokens(n), table)
    longer = block_table(layout, n, extra=10)
    assert layout.plan(tokens(n), longer) == layout.plan(tokens(n), block_table(layout, n))


def test_chunk_is_frozen():
    layout = load("llama-3.1-8b")
    [chunk] = layout.plan(tokens(256), block_table(layout, 256))
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.group = 1
