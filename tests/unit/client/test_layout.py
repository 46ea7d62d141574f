"""KVLayout: loading the reference layouts, validation, chunk geometry and the fingerprint."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_client.layout import KVGroup, KVLayout

LAYOUT_DIR = Path(__file__).parents[2] / "data" / "layouts"
LAYOUT_FILES = sorted(LAYOUT_DIR.glob("*.json"))
V4_FLASH = LAYOUT_DIR / "deepseek-v4-flash.json"


def load(path: Path) -> KVLayout:
    return KVLayout.from_dict(json.loads(path.read_text()))


def tiny(**overrides) -> KVLayout:
    kwargs = dict(
        groups=[KVGroup(tokens_per_block=16, page_bytes=8192, layer_names=("l0", "l2")),
                KVGroup(tokens_per_block=64, page_bytes=8192, layer_names=("l1", "l3"), sliding_window=512)],
        blocks_per_chunk=4, tokens_per_hash=16, model="tiny", dtype="bfloat16")
    kwargs.update(overrides)
    return KVLayout(**kwargs)


def replace_group(layout: KVLayout, g: int, **changes) -> KVLayout:
    groups = list(layout.groups)
    groups[g] = dataclasses.replace(groups[g], **changes)
    return dataclasses.replace(layout, groups=tuple(groups))


def test_reference_layouts_present():
    names = {p.stem for p in LAYOUT_FILES}
    assert {"deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "gemma-4-31b", "gpt-oss-120b",
            "hash-misaligned", "llama-3.1-8b", "llama-4-scout", "qwen3-next-80b-a3b"} <= names


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_from_dict_loads_reference_layout(path):
    data = json.loads(path.read_text())
    layout = KVLayout.from_dict(data)
    assert len(layout.groups) == len(data["groups"])
    for group, gd in zip(layout.groups, data["groups"]):
        assert group.layer_names == tuple(gd["layer_names"])
        pages = gd["page_bytes"]
        pages = tuple(pages) if isinstance(pages, list) else pages  # a JSON list becomes a tuple
        assert (group.tokens_per_block, group.page_bytes) == (gd["tokens_per_block"], pages)
        assert group.kind == gd["kind"]
        assert group.sliding_window == gd.get("sliding_window")
    assert layout.blocks_per_chunk == (data["blocks_per_chunk"],) * len(data["groups"])
    assert (layout.world_size, layout.rank, layout.kv_layout) == (1, 0, "default")


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_to_dict_round_trips(path):
    data = json.loads(path.read_text())
    layout = KVLayout.from_dict(data)
    out = json.loads(json.dumps(layout.to_dict()))  # JSON-serialisable
    assert KVLayout.from_dict(out) == layout
    assert {k: v for k, v in data.items() if k != "source"} == {k: out[k] for k in data if k != "source"}


def test_round_trip_keeps_chunk_tokens_and_per_group_blocks():
    by_tokens = dataclasses.replace(load(V4_FLASH), blocks_per_chunk=None, chunk_tokens=512)
    assert by_tokens.to_dict()["chunk_tokens"] == 512
    assert KVLayout.from_dict(by_tokens.to_dict()) == by_tokens
    per_group = tiny(blocks_per_chunk=(4, 2), world_size=4, rank=3, kv_layout="HND")
    assert per_group.to_dict()["blocks_per_chunk"] == [4, 2]
    assert KVLayout.from_dict(per_group.to_dict()) == per_group


def test_from_dict_does_not_mutate_input():
    data = json.loads(V4_FLASH.read_text())
    before = json.dumps(data, sort_keys=True)
    KVLayout.from_dict(data)
    assert json.dumps(data, sort_keys=True) == before


# -- per-group chunk geometry -----------------------------------------------------------------------


def test_pr48878_one_blocks_per_chunk_gives_per_group_tokens_per_chunk():
    # Chunking all groups by one model-wide block_size silently mis-chunked DeepSeek-V4-Flash.
    layout = load(V4_FLASH)
    assert [g.tokens_per_block for g in layout.groups] == [256, 64, 64, 4, 8]
    assert layout.blocks_per_chunk == (2, 2, 2, 2, 2)
    assert layout.tokens_per_chunk == (512, 128, 128, 8, 16)
    assert dataclasses.replace(layout, blocks_per_chunk=4).tokens_per_chunk == (1024, 256, 256, 16, 32)


def test_chunk_tokens_derives_blocks_per_chunk_per_group():
    layout = dataclasses.replace(load(V4_FLASH), blocks_per_chunk=None, chunk_tokens=512)
    assert layout.blocks_per_chunk == (2, 8, 8, 128, 64)
    assert layout.tokens_per_chunk == (512,) * 5
    gemma = dataclasses.replace(load(LAYOUT_DIR / "gemma-4-31b.json"), blocks_per_chunk=None, chunk_tokens=96)
    assert gemma.blocks_per_chunk == (6, 6, 6, 6, 6, 3)


def test_chunk_tokens_not_dividing_an_offloadable_group_names_group_value_and_lcm():
    base = load(V4_FLASH)
    with pytest.raises(ValueError, match=r"group 0: tokens_per_block=256 .*chunk_tokens=384.*multiple of 256"):
        dataclasses.replace(base, blocks_per_chunk=None, chunk_tokens=384)
    gemma = load(LAYOUT_DIR / "gemma-4-31b.json")
    with pytest.raises(ValueError, match=r"group 5: tokens_per_block=32 .*chunk_tokens=48.*multiple of 32"):
        dataclasses.replace(gemma, blocks_per_chunk=None, chunk_tokens=48)


def test_chunk_tokens_error_offers_the_lcm_of_offloadable_groups():
    groups = [KVGroup(tokens_per_block=48, page_bytes=64, layer_names=("a",)),
              KVGroup(tokens_per_block=32, page_bytes=64, layer_names=("b",)),
              KVGroup(tokens_per_block=40, page_bytes=64, layer_names=("c",))]  # skipped: 40 % 16 != 0
    with pytest.raises(ValueError, match=r"group 0: tokens_per_block=48 .*chunk_tokens=64.*multiple of 96 "):
        KVLayout(groups=groups, chunk_tokens=64, tokens_per_hash=16, model="m", dtype="bfloat16")
    ok = KVLayout(groups=groups, chunk_tokens=96, tokens_per_hash=16, model="m", dtype="bfloat16")
    assert ok.blocks_per_chunk == (2, 3, 0)


def test_chunk_tokens_not_dividing_a_skipped_group_gives_zero():
    layout = KVLayout(groups=[KVGroup(tokens_per_block=32, page_bytes=64, layer_names=("a",)),
                              KVGroup(tokens_per_block=12, page_bytes=64, layer_names=("b",))],
                      chunk_tokens=64, tokens_per_hash=16, model="m", dtype="bfloat16")
    assert layout.blocks_per_chunk == (2, 0)
    assert layout.offloadable == (True, False)
    assert layout.chunk_nbytes(1) == 0


def test_blocks_per_chunk_with_matching_chunk_tokens_is_accepted_and_mismatch_rejected():
    base = load(V4_FLASH)
    assert dataclasses.replace(base, blocks_per_chunk=(2, 8, 8, 128, 64), chunk_tokens=512).chunk_tokens == 512
    with pytest.raises(ValueError, match=r"blocks_per_chunk=.*chunk_tokens=512"):
        dataclasses.replace(base, blocks_per_chunk=2, chunk_tokens=512)
    with pytest.raises(ValueError, match="exactly one"):
        dataclasses.replace(base, blocks_per_chunk=None)


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_chunk_nbytes_is_blocks_times_the_sum_of_layer_pages(path):
    layout = load(path)
    raw = json.loads(path.read_text())
    for g, (group, gd) in enumerate(zip(layout.groups, raw["groups"])):
        pages = gd["page_bytes"]
        pages = pages if isinstance(pages, list) else [pages] * len(gd["layer_names"])
        assert layout.chunk_nbytes(g) == layout.blocks_per_chunk[g] * sum(pages) > 0


def test_hash_misaligned_group_keeps_its_index_and_is_reported():
    layout = load(LAYOUT_DIR / "hash-misaligned.json")
    assert layout.offloadable == (True, False, True)
    [(g, reason)] = layout.skipped_groups
    assert g == 1
    assert "group 1" in reason and "tokens_per_block=4" in reason and "tokens_per_hash=64" in reason
    assert layout.groups[2].layer_names[0] == "draft.0"  # the later group was not shifted down
    assert load(V4_FLASH).skipped_groups == ()


# -- KVGroup normalisation and validation -----------------------------------------------------------


def test_sliding_window_sets_default_kind_only():
    assert KVGroup(tokens_per_block=16, page_bytes=1, layer_names=("a",), sliding_window=8).kind == "sliding_window"
    assert KVGroup(tokens_per_block=16, page_bytes=1, layer_names=("a",)).kind == "full_attention"
    custom = KVGroup(tokens_per_block=16, page_bytes=1, layer_names=["a"], sliding_window=8,
                     kind="chunked_local_attention")
    assert custom.kind == "chunked_local_attention"
    assert custom.layer_names == ("a",)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens_per_block=0), r"tokens_per_block=0; allowed: a positive int"),
    (dict(page_bytes=-1), r"page_bytes=-1; allowed: a positive int"),
    (dict(tokens_per_block=True), r"tokens_per_block=True"),
    (dict(layer_names=()), r"layer_names=\(\); allowed"),
    (dict(layer_names=("a", "")), r"layer_names=.*allowed: one or more non-empty"),
    (dict(layer_names=("a", "b", "a")), r"repeats \['a'\]"),
    (dict(layer_names="ab"), r"layer_names='ab'"),
    (dict(sliding_window=0), r"sliding_window=0; allowed"),
    (dict(kind="sliding_window"), r"kind='sliding_window' with sliding_window=None"),
])
def test_kvgroup_rejects_bad_values(kwargs, match):
    args = dict(tokens_per_block=16, page_bytes=64, layer_names=("a",)) | kwargs
    with pytest.raises(ValueError, match=match):
        KVGroup(**args)


@pytest.mark.parametrize("overrides, match", [
    (dict(tokens_per_hash=0), r"tokens_per_hash=0; allowed: a positive int"),
    (dict(world_size=0), r"world_size=0"),
    (dict(world_size=2, rank=2), r"rank=2; allowed: an int in \[0, world_size=2\)"),
    (dict(rank=-1), r"rank=-1"),
    (dict(model=""), r"model=''"),
    (dict(blocks_per_chunk=(4,)), r"blocks_per_chunk=\(4,\); allowed: an int, or one int per group \(2 groups\)"),
    (dict(blocks_per_chunk=(4, 0)), r"group 1: blocks_per_chunk=0; allowed: a positive int"),
    (dict(blocks_per_chunk=0), r"group 0: blocks_per_chunk=0"),
    (dict(groups=[]), r"groups=\[\]; allowed: one or more KVGroup"),
])
def test_kvlayout_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny(**overrides)


def test_layer_names_unique_across_groups():
    groups = [KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("a", "b")),
              KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("c",)),
              KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("d", "b"))]
    with pytest.raises(ValueError, match=r"group 2: layer 'b' is already in group 0"):
        tiny(groups=groups)


def test_from_dict_errors_name_the_group_and_the_key():
    data = json.loads(V4_FLASH.read_text())
    data["groups"][2]["page_bytes"] = 0
    with pytest.raises(ValueError, match=r"group 2: .*page_bytes=0"):
        KVLayout.from_dict(data)
    data = json.loads(V4_FLASH.read_text())
    data["groups"][3]["tokens_per_blok"] = 4
    with pytest.raises(ValueError, match=r"group 3: unknown keys \['tokens_per_blok'\]"):
        KVLayout.from_dict(data)
    with pytest.raises(ValueError, match=r"unknown layout keys \['block_size'\]"):
        KVLayout.from_dict({**json.loads(V4_FLASH.read_text()), "block_size": 256})
    with pytest.raises(ValueError, match=r"missing layout keys \['tokens_per_hash'\]"):
        KVLayout.from_dict({k: v for k, v in json.loads(V4_FLASH.read_text()).items() if k != "tokens_per_hash"})


# -- fingerprint ------------------------------------------------------------------------------------


def _variants(base: KVLayout) -> dict[str, KVLayout]:
    assert base.groups[1].sliding_window is not None and base.world_size == 1
    two_ranks = dataclasses.replace(base, world_size=2)
    return {
        "model": dataclasses.replace(base, model=base.model + "-x"),
        "dtype": dataclasses.replace(base, dtype="float16"),
        "kv_layout": dataclasses.replace(base, kv_layout="HND"),
        "page_bytes": replace_group(base, 2, page_bytes=base.groups[2].page_bytes * 2),
        "tokens_per_block": replace_group(base, 0, tokens_per_block=base.groups[0].tokens_per_block * 2),
        "layer_count": replace_group(base, 3, layer_names=base.groups[3].layer_names[:-1]),
        "kind": replace_group(base, 0, kind="full_attention"),
        "sliding_window": replace_group(base, 1, sliding_window=base.groups[1].sliding_window * 2),
        "blocks_per_chunk": dataclasses.replace(base, blocks_per_chunk=(2, 2, 2, 2, 4)),
        "world_size": two_ranks,
        "rank": dataclasses.replace(two_ranks, rank=1),
        "group_order": dataclasses.replace(base, groups=base.groups[::-1]),
    }


def test_fingerprint_is_sha256_hex_and_stable_in_process():
    a, b = load(V4_FLASH), load(V4_FLASH)
    assert a is not b
    assert a.fingerprint == b.fingerprint == a.fingerprint
    assert len(a.fingerprint) == 64 and int(a.fingerprint, 16) >= 0
    assert a.namespace == f"deepseek-v4-flash/{a.fingerprint[:16]}"


def test_fingerprint_changes_with_every_byte_deciding_field():
    base = load(V4_FLASH)
    variants = _variants(base)
    prints = {name: v.fingerprint for name, v in variants.items()}
    unchanged = [name for name, fp in prints.items() if fp == base.fingerprint]
    assert unchanged == []
    assert len(set(prints.values())) == len(prints)  # and no two variants collide


def test_fingerprint_ignores_layer_names():
    base = load(V4_FLASH)
    renamed = replace_group(base, 0, layer_names=tuple(f"renamed.{i}" for i in range(6)))
    assert renamed != base
    assert renamed.fingerprint == base.fingerprint


def test_fingerprint_same_with_chunk_tokens_or_equivalent_blocks_per_chunk():
    derived = dataclasses.replace(load(V4_FLASH), blocks_per_chunk=None, chunk_tokens=512)
    explicit = dataclasses.replace(load(V4_FLASH), blocks_per_chunk=(2, 8, 8, 128, 64))
    assert derived.fingerprint == explicit.fingerprint != load(V4_FLASH).fingerprint


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_fingerprint_stable_across_processes(path):
    code = ("import json, sys; from kvtier_client.layout import KVLayout; "
            "print(KVLayout.from_dict(json.load(open(sys.argv[1]))).fingerprint)")
    # A different hash seed proves the fingerprint does not lean on Python's hash().
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == load(path).fingerprint
