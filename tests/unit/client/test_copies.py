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
