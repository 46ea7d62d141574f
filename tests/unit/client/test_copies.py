"""The torch reference gather/scatter: the semantics the GPU kernels are checked against."""

import pytest
import torch

from kvtier_client.copies import CopyUnit, build_page_tables, gather, page_view, scatter
from kvtier_client.layout import KVGroup, KVLayout

GEN = torch.Generator().manual_seed(7)


def rand_bytes(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=GEN)


def layout_two_groups(page_a=100, page_b=36):
    return KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=page_a, layer_names=("a0", "a1")),
                KVGroup(tokens_per_block=64, page_bytes=page_b, layer_names=("b0", "b1", "b2"))],
        blocks_per_chunk=3, tokens_per_hash=16, model="m", dtype="bfloat16")


def expected_payload(kv, layout, unit):
    """Independent restatement of the payload: [layer][block][page_bytes], -1 blocks absent."""
    group = layout.groups[unit.group]
    parts = []
    for name in group.layer_names:
        raw = kv[name].contiguous().view(torch.uint8).reshape(kv[name].shape[0], -1)
        for b in unit.block_ids:
            parts.append(None if b == -1 else raw[b, :group.page_bytes])
    return parts


def test_gather_lays_out_layer_block_page_for_a_mixed_batch():
    layout = layout_two_groups()
    kv = {n: rand_bytes(10, 128) for n in ("a0", "a1", "b0", "b1", "b2")}
    units = [CopyUnit(0, (4, 1, 7), 0), CopyUnit(1, (2, 9, 0), 1000), CopyUnit(0, (0, 3, 5), 2000)]
    staging = torch.full((4000,), 0xAB, dtype=torch.uint8)
    gather(build_page_tables(layout, kv), units, staging)
    for unit in units:
        page = layout.groups[unit.group].page_bytes
        for i, part in enumerate(expected_payload(kv, layout, unit)):
            start = unit.staging_offset + i * page
            assert torch.equal(staging[start:start + page], part)
    # bytes between units are untouched
    assert torch.all(staging[900:1000] == 0xAB) and torch.all(staging[3000:] == 0xAB)


def test_minus_one_blocks_are_skipped_both_ways():
    layout = layout_two_groups()
    kv = {n: rand_bytes(10, 128) for n in ("a0", "a1", "b0", "b1", "b2")}
    unit = CopyUnit(0, (3, -1, 6), 0)
    staging = torch.full((600,), 0xAB, dtype=torch.uint8)
    gather(build_page_tables(layout, kv), [unit], staging)
    assert torch.all(staging[100:200] == 0xAB) and torch.all(staging[400:500] == 0xAB)
    before = {n: t.clone() for n, t in kv.items()}
    for t in kv.values():
        t.fill_(0x11)
    staging[100:200] = 0x77  # what a -1 slot holds must never reach a block
    scatter(build_page_tables(layout, kv), [unit], staging)
    for name in ("a0", "a1"):
        for b in range(10):
            want = before[name][b, :100] if b in (3, 6) else torch.full((100,), 0x11, dtype=torch.uint8)
            assert torch.equal(kv[name][b, :100], want), (name, b)
        assert torch.all(kv[name][:, 100:] == 0x11)  # bytes past page_bytes untouched


def test_round_trip_through_strided_views_and_other_dtypes():
    # K and V packed in one tensor: a block's page is the K half, so stride(0) > page bytes.
    packed = torch.randn(12, 2, 8, 4, dtype=torch.bfloat16, generator=GEN)
    k_view = packed[:, 0]
    assert k_view.stride(0) * 2 > 8 * 4 * 2
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("k",))],
                      blocks_per_chunk=2, tokens_per_hash=16, model="m", dtype="bfloat16")
    units = [CopyUnit(0, (5, 2), 0), CopyUnit(0, (11, 0), 256)]
    staging = torch.full((512,), 0xAB, dtype=torch.uint8)
    gather(build_page_tables(layout, {"k": k_view}), units, staging)
    original = packed.clone()
    packed.fill_(1.5)
    scatter(build_page_tables(layout, {"k": k_view}), units, staging)
    for b in (5, 2, 11, 0):
        assert torch.equal(packed[b, 0].view(torch.uint8), original[b, 0].view(torch.uint8))
    assert torch.all(packed[:, 1] == 1.5)  # the V half was never touched
    assert torch.all(packed[1, 0] == 1.5)  # nor blocks outside the units


def test_odd_page_size_copies_only_the_page_prefix():
    layout = KVLayout(groups=[KVGroup(tokens_per_block=4, page_bytes=13, layer_names=("x",))],
                      blocks_per_chunk=1, tokens_per_hash=4, model="m", dtype="int8")
    kv = {"x": rand_bytes(3, 20)}
    staging = torch.full((64,), 0xAB, dtype=torch.uint8)
    gather(build_page_tables(layout, kv), [CopyUnit(0, (2,), 7)], staging)
    assert torch.equal(staging[7:20], kv["x"][2, :13])
    assert torch.all(staging[:7] == 0xAB) and torch.all(staging[20:] == 0xAB)


@pytest.mark.parametrize("tensor, match", [
    (torch.zeros(4, 8, dtype=torch.uint8), "smaller than page_bytes=16"),
    (torch.zeros(4, 32, dtype=torch.uint8)[:, :16].t().contiguous().t(), "block stride"),
    (torch.zeros(0, 32, dtype=torch.uint8), "no block dimension"),
])
def test_page_view_refuses_tensors_that_cannot_hold_pages(tensor, match):
    with pytest.raises(ValueError, match=match):
        page_view("layer.3", tensor, 16, group=2)


def test_missing_layer_names_group_and_layer():
    layout = layout_two_groups()
    kv = {n: rand_bytes(4, 128) for n in ("a0", "a1", "b0", "b2")}
    with pytest.raises(ValueError, match=r"group 1: layer 'b1' is missing"):
        build_page_tables(layout, kv)


# -- per-layer page sizes -----------------------------------------------------------------------------


def layout_per_layer(pages=(100, 36, 7, 64)):
    return KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=(48, 48), layer_names=("u0", "u1")),
                            KVGroup(tokens_per_block=64, page_bytes=pages, kind="mla",
                                    layer_names=tuple(f"m{i}" for i in range(len(pages))))],
                    blocks_per_chunk=3, tokens_per_hash=16, model="m", dtype="fp8_ds_mla")


def per_layer_kv(layout, blocks=10, pad=9):
    """Per layer a [blocks, page + pad] tensor of random bytes: pad bytes after every page."""
    return {name: rand_bytes(blocks, page + pad)
            for group in layout.groups
            for name, page in zip(group.layer_names, group.layer_page_bytes)}


def test_gather_with_per_layer_pages_puts_each_layer_at_its_own_offset():
    layout = layout_per_layer()
    kv = per_layer_kv(layout)
    units = [CopyUnit(1, (4, 1, 7), 0), CopyUnit(0, (2, 9, 0), 700), CopyUnit(1, (0, 3, -1), 1100)]
    staging = torch.full((2000,), 0xAB, dtype=torch.uint8)
    gather(build_page_tables(layout, kv), units, staging)
    for unit in units:
        group = layout.groups[unit.group]
        pos = unit.staging_offset  # [layer][block][page], each layer with its own page size
        for name, page in zip(group.layer_names, group.layer_page_bytes):
            for b in unit.block_ids:
                got = staging[pos:pos + page]
                want = torch.full((page,), 0xAB, dtype=torch.uint8) if b == -1 else kv[name][b, :page]
                assert torch.equal(got, want), (unit, name, b)
                pos += page
        assert pos - unit.staging_offset == layout.chunk_nbytes(unit.group)
    assert torch.all(staging[3 * 207:700] == 0xAB) and torch.all(staging[700 + 288:1100] == 0xAB)
    assert torch.all(staging[1100 + 3 * 207:] == 0xAB)


def test_scatter_with_per_layer_pages_writes_only_each_layers_page():
    layout = layout_per_layer()
    source = per_layer_kv(layout)
    units = [CopyUnit(1, (4, 1, 7), 0), CopyUnit(1, (8, -1, 2), 1000)]
    staging = torch.full((2000,), 0xAB, dtype=torch.uint8)
    gather(build_page_tables(layout, source), units, staging)
    kv = {name: torch.full_like(t, 0x5C) for name, t in source.items()}  # poisoned destination
    scatter(build_page_tables(layout, kv), units, staging)
    written = {(1, 4), (1, 1), (1, 7), (1, 8), (1, 2)}
    for g, group in enumerate(layout.groups):
        for name, page in zip(group.layer_names, group.layer_page_bytes):
            for b in range(10):
                want = source[name][b, :page] if (g, b) in written else torch.full(
                    (page,), 0x5C, dtype=torch.uint8)
                assert torch.equal(kv[name][b, :page], want), (name, b)
            assert torch.all(kv[name][:, page:] == 0x5C), name  # the padding after each page


def test_per_layer_pages_are_checked_against_each_layers_tensor():
    layout = layout_per_layer()
    kv = per_layer_kv(layout, pad=0)
    kv["m2"] = rand_bytes(10, 6)  # layer m2's page is 7 bytes
    with pytest.raises(ValueError, match=r"group 1 layer 'm2': a block has 6 bytes, smaller than "
                                         r"page_bytes=7"):
        build_page_tables(layout, kv)
