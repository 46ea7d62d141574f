"""The memmove fast path for CPU tensors, checked byte for byte against the torch reference."""

import ctypes
import random

import pytest
import torch

from kvtier_client import host_copies
from kvtier_client.copies import CopyUnit, build_page_tables, gather, scatter
from kvtier_client.layout import KVGroup, KVLayout
from kvtierd.copy import _ranges

GEN = torch.Generator().manual_seed(11)
POISON = 0xAB


def rand_bytes(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=GEN)


def mixed_layout(bpc=3):
    """Two groups, one of them with per-layer page sizes (MLA latent + indexer style)."""
    return KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=(100, 36, 100), layer_names=("a0", "a1", "a2")),
                KVGroup(tokens_per_block=64, page_bytes=64, layer_names=("b0", "b1"))],
        blocks_per_chunk=bpc, tokens_per_hash=16, model="m", dtype="bfloat16")


def caches(layout, blocks=12, row=128, shared=False):
    """Random caches; with ``shared`` every layer is a slice of one allocation (runs may merge
    across layers), else one tensor per layer with a padded row (stride > page)."""
    names = [n for g in layout.groups for n in g.layer_names]
    if shared:
        page = max(p for g in layout.groups for p in g.layer_page_bytes)
        whole = rand_bytes(len(names), blocks, page)
        return {n: whole[i] for i, n in enumerate(names)}
    return {n: rand_bytes(blocks, row) for n in names}


def random_units(layout, rng, count, blocks, minus_one=True):
    units, offset = [], 0
    for _ in range(count):
        g = rng.randrange(len(layout.groups))
        ids = [rng.randrange(blocks) for _ in range(layout.blocks_per_chunk[g])]
        if minus_one and rng.random() < 0.3:
            ids[rng.randrange(len(ids))] = -1
        units.append(CopyUnit(g, tuple(ids), offset))
        offset += layout.chunk_nbytes(g) + rng.choice((0, 7, 256))  # gaps stay untouched
    return units, offset


def check_gather(tables, units, end):
    """The fast gather and the torch reference fill poisoned staging with the same bytes."""
    want = torch.full((end + 64,), POISON, dtype=torch.uint8)
    got = want.clone()
    gather(tables, units, want)
    host_copies.gather(host_copies.geometries(tables), units, got)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_gather_equals_the_reference_byte_for_byte(seed, shared):
    rng = random.Random(seed)
    layout = mixed_layout(bpc=rng.choice((1, 3, 4)))
    kv = caches(layout, shared=shared)
    tables = build_page_tables(layout, kv)
    units, end = random_units(layout, rng, 9, 12)
    check_gather(tables, units, end)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_scatter_equals_the_reference_byte_for_byte(seed, shared):
    rng = random.Random(100 + seed)
    layout = mixed_layout(bpc=rng.choice((1, 3, 4)))
    # distinct block ids per group, as a real load has (one block is never loaded twice)
    kv_want = caches(layout, blocks=40, shared=shared)
    kv_got = {n: t.clone() for n, t in kv_want.items()}
    units, end, used = [], 0, {0: set(), 1: set()}
    for _ in range(8):
        g = rng.randrange(2)
        free = [b for b in range(40) if b not in used[g]]
        ids = rng.sample(free, layout.blocks_per_chunk[g])
        used[g].update(ids)
        if rng.random() < 0.3:
            ids[0] = -1
        units.append(CopyUnit(g, tuple(ids), end))
        end += layout.chunk_nbytes(g) + 13
    staging = rand_bytes(end)
    scatter(build_page_tables(layout, kv_want), units, staging)
    host_copies.scatter(host_copies.geometries(build_page_tables(layout, kv_got)), units, staging)
    for name in kv_want:
        assert torch.equal(kv_got[name], kv_want[name]), name


def test_consecutive_blocks_of_a_contiguous_cache_become_one_run():
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=256, layer_names=("x", "y"))],
                      blocks_per_chunk=4, tokens_per_hash=16, model="m", dtype="bfloat16")
    whole = rand_bytes(2, 8, 256)  # layer y's blocks follow layer x's
    tables = build_page_tables(layout, {"x": whole[0], "y": whole[1]})
    staging = torch.full((layout.chunk_nbytes(0),), POISON, dtype=torch.uint8)
    geo = host_copies.geometries(tables)
    unit = CopyUnit(0, (4, 5, 6, 7), 0)
    # x's blocks 4..7 end where y's block 0 starts, not y's block 4: two runs, each 4 pages
    assert host_copies.gather(geo, [unit], staging) == 2
    assert torch.equal(staging, torch.cat([whole[0, 4:8].flatten(), whole[1, 4:8].flatten()]))
    staging.fill_(POISON)
    assert host_copies.gather(geo, [CopyUnit(0, (5, 4, -1, 7), 0)], staging) == 6
    pages = staging.view(2, 4, 256)
    for layer in range(2):
        for position, block in enumerate((5, 4, -1, 7)):
            want = torch.full((256,), POISON, dtype=torch.uint8) if block == -1 else whole[layer, block]
            assert torch.equal(pages[layer, position], want), (layer, position)
    poisoned = {n: torch.full_like(t, POISON) for n, t in (("x", whole[0]), ("y", whole[1]))}
    back = host_copies.geometries(build_page_tables(layout, poisoned))
    assert host_copies.scatter(back, [unit], torch.cat([whole[0, 4:8].flatten(),
                                                        whole[1, 4:8].flatten()])) == 2
    for name, layer in (("x", 0), ("y", 1)):
        assert torch.equal(poisoned[name][4:8], whole[layer, 4:8])
        assert torch.all(poisoned[name][:4] == POISON) and torch.all(poisoned[name][8:] == POISON)


def test_runs_merge_across_units_and_layers_of_one_allocation():
    """One allocation whose layers follow each other, units of consecutive blocks laid out back
    to back: the whole batch is copied by as few memmoves as the geometry allows."""
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=256, layer_names=("x",))],
                      blocks_per_chunk=2, tokens_per_hash=16, model="m", dtype="bfloat16")
    whole = rand_bytes(8, 256)
    geo = host_copies.geometries(build_page_tables(layout, {"x": whole}))
    staging = torch.full((4 * 512,), POISON, dtype=torch.uint8)
    units = [CopyUnit(0, (2 * i, 2 * i + 1), 512 * i) for i in range(4)]  # blocks 0..7 in order
    assert host_copies.gather(geo, units, staging) == 1
    assert torch.equal(staging, whole.flatten())


def test_runs_that_continue_in_the_cache_but_not_in_staging_stay_apart():
    """Blocks next to each other in the cache but not in staging (a -1 between them, or a gap
    between two units) are two memmoves, each landing at its own staging offset."""
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=256, layer_names=("x",))],
                      blocks_per_chunk=3, tokens_per_hash=16, model="m", dtype="bfloat16")
    whole = rand_bytes(8, 256)
    geo = host_copies.geometries(build_page_tables(layout, {"x": whole}))
    staging = torch.full((2 * 768 + 100,), POISON, dtype=torch.uint8)
    units = [CopyUnit(0, (2, -1, 3), 0),  # 2 and 3 touch in the cache, not in staging
             CopyUnit(0, (4, 5, 6), 768 + 100)]  # follows block 3 in the cache, 100 bytes on
    assert host_copies.gather(geo, units, staging) == 3
    poison = torch.full((256,), POISON, dtype=torch.uint8)
    assert torch.equal(staging[:768], torch.cat([whole[2], poison, whole[3]]))
    assert torch.all(staging[768:868] == POISON)
    assert torch.equal(staging[868:], whole[4:7].flatten())
    back = torch.full_like(whole, POISON)
    geo_back = host_copies.geometries(build_page_tables(layout, {"x": back}))
    assert host_copies.scatter(geo_back, units, staging) == 3
    assert torch.equal(back[2:7], whole[2:7])
    assert torch.all(back[:2] == POISON) and torch.all(back[7:] == POISON)


def test_a_unit_outside_the_staging_buffer_is_refused_before_any_copy():
    layout = mixed_layout()
    kv = caches(layout)
    geo = host_copies.geometries(build_page_tables(layout, kv))
    staging = torch.full((layout.chunk_nbytes(0) + 10,), POISON, dtype=torch.uint8)
    with pytest.raises(ValueError, match="leaves the staging buffer"):
        host_copies.gather(geo, [CopyUnit(0, (1, 2, 3), 11)], staging)
    assert torch.all(staging == POISON)
    # a good unit of group 0 and a bad one of group 1: the check of every group comes first
    with pytest.raises(ValueError, match="leaves the staging buffer"):
        host_copies.gather(geo, [CopyUnit(0, (1, 2, 3), 0), CopyUnit(1, (4, 5, 6), 400)], staging)
    assert torch.all(staging == POISON)
    before = {n: t.clone() for n, t in kv.items()}
    with pytest.raises(ValueError, match="leaves the staging buffer"):
        host_copies.scatter(geo, [CopyUnit(0, (1, 2, 3), 0), CopyUnit(1, (4, 5, 6), 400)], staging)
    assert all(torch.equal(kv[n], before[n]) for n in kv)


def test_the_gather_copies_with_the_daemons_streaming_stores_where_built():
    copy = host_copies._streaming_copy()
    assert ctypes_address(copy) == _ranges.streaming_copy_address()  # the build is in place
    src = bytearray(random.Random(3).randbytes(3 * 4096 + 77))
    dst = bytearray([POISON]) * (len(src) + 40)
    copy(address_of(dst) + 5, address_of(src) + 3, len(src) - 3)
    assert dst == bytes([POISON]) * 5 + src[3:] + bytes([POISON]) * 38


@pytest.mark.parametrize("seed", range(4))
def test_gather_of_pages_past_a_streamed_line_equals_the_reference(seed):
    """Pages long enough for the streaming body, at staging offsets off every 16-byte line."""
    rng = random.Random(500 + seed)
    layout = KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=(4099, 200, 8192),
                        layer_names=("a0", "a1", "a2"))],
        blocks_per_chunk=rng.choice((1, 2, 3)), tokens_per_hash=16, model="m", dtype="bfloat16")
    kv = caches(layout, blocks=10, row=8192 + 64)
    tables = build_page_tables(layout, kv)
    units, end = random_units(layout, rng, 7, 10)
    check_gather(tables, units, end)


def ctypes_address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def address_of(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
