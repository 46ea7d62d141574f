"""The CuPy kernels against the torch reference on the GPU, byte for byte, on random data with
poisoned destinations: every reference layout (scaled down), odd pages, strided views, -1 blocks."""

from __future__ import annotations

import pytest
import torch

from helpers.kv import LAYOUT_FILES, load_layout
from kvtier_client.copies import CopyUnit, build_page_tables, gather, scatter
from kvtier_client.cuda_staging import CudaCopier
from kvtier_client.layout import KVGroup, KVLayout

POISON = 0xAB


def rand(shape, gen, dtype=torch.uint8):
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).cuda()


def units_for(layout, blocks, count, gen, minus_one=0.2, align=256, start=0):
    units, offset = [], start
    groups = [g for g, ok in enumerate(layout.offloadable) if ok]
    for i in range(count):
        g = groups[i % len(groups)]
        ids = torch.randperm(blocks[g], generator=gen)[:layout.blocks_per_chunk[g]].tolist()
        ids = [-1 if torch.rand(1, generator=gen).item() < minus_one else b for b in ids]
        units.append(CopyUnit(g, tuple(ids), offset))
        offset = -(-(offset + layout.chunk_nbytes(g)) // align) * align
    return units, offset


def poisoned_like(kv):
    out = {}
    for name, t in kv.items():
        raw = torch.full((t.untyped_storage().nbytes(),), POISON, dtype=torch.uint8, device="cuda")
        out[name] = torch.empty(0, dtype=t.dtype, device="cuda").set_(
            raw.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return out


def check(layout, kv, units, nbytes, base=0):
    tables = build_page_tables(layout, kv)
    copier = CudaCopier(tables, layout.blocks_per_chunk, torch.device("cuda", 0))
    staging = copier.new_staging(nbytes + base)
    try:
        staging.tensor.fill_(POISON)
        ref = torch.full((nbytes + base,), POISON, dtype=torch.uint8, device="cuda")
        gather(tables, units, ref[base:])
        shifted = [CopyUnit(u.group, u.block_ids, u.staging_offset + base) for u in units]
        copier.gather(shifted, staging, copier.caller_ready())  # after the fills above
        torch.cuda.synchronize()
        assert torch.equal(staging.tensor, ref), "gather differs from the torch reference"
        kv_ref, kv_got = poisoned_like(kv), poisoned_like(kv)
        scatter(build_page_tables(layout, kv_ref), units, ref[base:])
        got_copier = CudaCopier(build_page_tables(layout, kv_got), layout.blocks_per_chunk,
                                torch.device("cuda", 0))
        got_copier.scatter(shifted, staging, got_copier.caller_ready())
        torch.cuda.synchronize()
        for name in kv:
            a = torch.empty(0, dtype=torch.uint8, device="cuda").set_(kv_ref[name].untyped_storage())
            b = torch.empty(0, dtype=torch.uint8, device="cuda").set_(kv_got[name].untyped_storage())
            assert torch.equal(a, b), f"scatter differs in layer {name}"
    finally:
        staging.free()


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("page", [4096, 544, 1000])
def test_reference_layouts(path, page):
    gen = torch.Generator().manual_seed(page)
    layout = load_layout(path, page_bytes=page, layers_per_group=3)
    blocks = [layout.blocks_per_chunk[g] * 4 + 3 for g in range(len(layout.groups))]
    kv = {n: rand((blocks[g], p), gen) for g, gr in enumerate(layout.groups)
          for n, p in zip(gr.layer_names, gr.layer_page_bytes)}
    units, end = units_for(layout, blocks, 23, gen)
    check(layout, kv, units, end)


@pytest.mark.parametrize("align, base", [(1, 3), (16, 0), (256, 8)])
def test_per_layer_page_sizes(align, base):
    gen = torch.Generator().manual_seed(align + base)
    pages = (41984 // 8, 8448 // 8, 657, 17)  # MLA latent + indexer cache pages, and odd ones
    layout = KVLayout(groups=[KVGroup(tokens_per_block=64, page_bytes=pages, kind="mla",
                                      layer_names=("a0", "i0", "a1", "i1")),
                              KVGroup(tokens_per_block=16, page_bytes=(64, 64), layer_names=("u0", "u1"))],
                      blocks_per_chunk=(3, 2), tokens_per_hash=16, model="m", dtype="fp8_ds_mla")
    kv = {n: rand((14, p + 7), gen)[:, i % 4:i % 4 + p]
          for i, (n, p) in enumerate(zip(layout.groups[0].layer_names, pages))}
    kv |= {"u0": rand((10, 64), gen), "u1": rand((10, 2, 64), gen)[:, 1]}
    units, end = units_for(layout, [14, 10], 17, gen, align=align, start=align % 5)
    check(layout, kv, units, end, base)


@pytest.mark.parametrize("page", [1, 13, 17, 4095, 4097, 37377])
@pytest.mark.parametrize("align, base", [(1, 3), (16, 0), (256, 8)])
def test_odd_pages_and_offsets(page, align, base):
    gen = torch.Generator().manual_seed(page * 7 + align)
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=page, layer_names=("a", "b"))],
                      blocks_per_chunk=3, tokens_per_hash=16, model="m", dtype="int8")
    kv = {"a": rand((12, page + 5), gen)[:, 1:page + 1], "b": rand((12, page), gen)}
    units, end = units_for(layout, [12], 9, gen, align=align, start=align % 5)
    check(layout, kv, units, end, base)


def test_packed_split_and_padded_views_mixed_groups():
    gen = torch.Generator().manual_seed(3)
    packed = rand((40, 2, 16, 8, 64), gen, torch.bfloat16)  # vLLM: [blocks, K/V, tokens, heads, d]
    split = rand((40, 16, 8, 64), gen, torch.bfloat16)
    padded = rand((40, 16 * 8 * 64 + 40), gen, torch.bfloat16)[:, 8:8 + 16 * 8 * 64]
    page = 16 * 8 * 64 * 2
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=page, layer_names=("k", "v")),
                              KVGroup(tokens_per_block=64, page_bytes=page, layer_names=("s", "p"))],
                      blocks_per_chunk=(4, 1), tokens_per_hash=16, model="m", dtype="bfloat16")
    kv = {"k": packed[:, 0], "v": packed[:, 1], "s": split, "p": padded}
    units, end = units_for(layout, [40, 40], 30, gen)
    check(layout, kv, units, end)
