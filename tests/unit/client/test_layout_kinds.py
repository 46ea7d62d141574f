"""KVGroup kinds (a closed set with vLLM's names) and per-layer page sizes: validation, chunk
geometry, the dict form and the fingerprint."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvtier_client.layout import KIND_NAMES, KVGroup, KVLayout

LAYOUT_DIR = Path(__file__).parents[2] / "data" / "layouts"
WINDOWED = {"sliding_window", "chunked_local_attention"}


def group(**kwargs) -> KVGroup:
    return KVGroup(**({"tokens_per_block": 16, "page_bytes": 64, "layer_names": ("a", "b")} | kwargs))


def layout(*groups: KVGroup, tokens_per_hash: int = 16, **kwargs) -> KVLayout:
    return KVLayout(groups=groups, blocks_per_chunk=kwargs.pop("blocks_per_chunk", 2),
                    tokens_per_hash=tokens_per_hash, model="m", dtype="bfloat16", **kwargs)


# -- kinds ------------------------------------------------------------------------------------------


def test_kind_names_are_vllms_closed_set():
    assert KIND_NAMES == ("full_attention", "sliding_window", "chunked_local_attention", "mla",
                          "mla_indexer", "mamba")


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_every_kind_is_accepted_and_kept(kind):
    window = 4096 if kind in WINDOWED else None
    g = group(kind=kind, sliding_window=window)
    assert (g.kind, g.sliding_window) == (kind, window)
    assert g.is_state == (kind == "mamba")
    assert KVLayout.from_dict(layout(g).to_dict()).groups[0] == g


def test_cross_attention_is_refused_with_the_reason_and_the_allowed_set():
    with pytest.raises(ValueError) as info:
        group(kind="cross_attention")
    msg = str(info.value)
    assert "kind='cross_attention'" in msg and "encoder input" in msg
    assert str(KIND_NAMES) in msg and "layer_names[0]='a'" in msg


@pytest.mark.parametrize("kind", ["attention", "Full_Attention", "linear_attention", "gdn", "", 3,
                                  None, ["mla"]])
def test_unknown_kind_is_refused_naming_it_and_the_allowed_set(kind):
    with pytest.raises(ValueError, match=re.escape(f"kind={kind!r}; allowed: one of ('full_attention', ")):
        group(kind=kind)


@pytest.mark.parametrize("kind, what", [("sliding_window", "the window"),
                                        ("chunked_local_attention", "the attention chunk size")])
def test_windowed_kinds_need_their_window(kind, what):
    with pytest.raises(ValueError, match=rf"kind='{kind}' with sliding_window=None; allowed: {what}"):
        group(kind=kind)


@pytest.mark.parametrize("kind", ["mla", "mla_indexer", "mamba"])
def test_a_window_on_a_kind_without_one_is_refused(kind):
    with pytest.raises(ValueError, match=rf"sliding_window=128 with kind='{kind}'; allowed: a window "
                                         r"only for kinds \('sliding_window', 'chunked_local_attention'\)"):
        group(kind=kind, sliding_window=128)


def test_chunked_local_keeps_its_kind_and_chunk_size():
    g = group(kind="chunked_local_attention", sliding_window=8192)
    assert (g.kind, g.sliding_window) == ("chunked_local_attention", 8192)
    plain = group(sliding_window=8192)  # a window alone still means a sliding window
    assert plain.kind == "sliding_window"
    assert layout(g).fingerprint != layout(plain).fingerprint


def test_from_dict_names_the_group_of_a_refused_kind():
    data = json.loads((LAYOUT_DIR / "llama-4-scout.json").read_text())
    data["groups"][2]["kind"] = "cross_attention"
    with pytest.raises(ValueError, match=r"group 2: .*kind='cross_attention'"):
        KVLayout.from_dict(data)


# -- a skipped state group beside offloaded groups ----------------------------------------------------


def test_skipped_state_group_with_offloaded_attention_is_refused():
    state = group(tokens_per_block=24, kind="mamba", layer_names=("s",))  # 24 % 16 != 0: skipped
    full = group(layer_names=("f",))
    with pytest.raises(ValueError, match=r"group 1: kind='mamba' with tokens_per_block=24 is not a "
                                         r"multiple of tokens_per_hash=16.*groups \[0\].*unusable"):
        layout(full, state)


def test_skipped_attention_group_or_all_groups_skipped_is_allowed():
    state = group(tokens_per_block=32, kind="mamba", layer_names=("s",))
    tail = group(tokens_per_block=4, kind="mla_indexer", layer_names=("i",))
    ok = layout(state, tail)
    assert [g for g, _ in ok.skipped_groups] == [1]
    alone = layout(group(tokens_per_block=24, kind="mamba", layer_names=("s",)),
                   group(tokens_per_block=8, layer_names=("f",)))
    assert alone.offloadable == (False, False)


# -- per-layer page sizes -----------------------------------------------------------------------------


def test_per_layer_pages_give_helpers_and_chunk_bytes():
    g = group(page_bytes=(41984, 8448), layer_names=("attn.0", "indexer.0"), kind="mla")
    assert g.layer_page_bytes == (41984, 8448) and g.group_page_bytes == 50432
    assert layout(g, blocks_per_chunk=4).chunk_nbytes(0) == 4 * 50432
    uniform = group(page_bytes=100, layer_names=("x", "y", "z"))
    assert uniform.layer_page_bytes == (100, 100, 100) and uniform.group_page_bytes == 300


def test_a_list_becomes_a_tuple_and_equal_entries_stay_a_tuple():
    g = group(page_bytes=[64, 64])
    assert g.page_bytes == (64, 64)
    assert g != group(page_bytes=64)  # not normalised: to_dict gives back what came in
    assert g.to_dict()["page_bytes"] == [64, 64]
    assert KVGroup(**g.to_dict()) == g
    hash(g)  # still usable as a dict key


@pytest.mark.parametrize("pages, match", [
    ((64,), r"page_bytes=\[64\]; allowed: a positive int, or one positive int per layer \(2 layers\)"),
    ((64, 64, 64), r"page_bytes=\[64, 64, 64\]; allowed: .*\(2 layers\)"),
    ((64, 0), r"page_bytes=\[64, 0\]"),
    ((64, -8), r"page_bytes=\[64, -8\]"),
    ((64, True), r"page_bytes=\[64, True\]"),
    ((64, 8.0), r"page_bytes=\[64, 8.0\]"),
    ("64", r"page_bytes='64'"),
    (b"\x40\x40", r"page_bytes=b'@@'"),
    ((), r"page_bytes=\[\]"),
])
def test_bad_per_layer_pages_are_refused(pages, match):
    with pytest.raises(ValueError, match=match):
        group(page_bytes=pages)


def test_from_dict_reads_a_json_list_and_round_trips():
    data = json.loads((LAYOUT_DIR / "deepseek-v3.2.json").read_text())
    lay = KVLayout.from_dict(data)
    (g,) = lay.groups
    assert len(g.layer_names) == 122 and g.layer_page_bytes[:2] == (41984, 8448)
    assert lay.chunk_nbytes(0) == 4 * 61 * (64 * 656 + 64 * 132)
    out = json.loads(json.dumps(lay.to_dict()))
    assert out["groups"][0]["page_bytes"] == data["groups"][0]["page_bytes"]
    assert KVLayout.from_dict(out) == lay


# -- fingerprint --------------------------------------------------------------------------------------


def test_equal_per_layer_pages_fingerprint_like_the_int():
    # the same bytes: [layer][block][page] with equal pages is the int layout's payload
    as_int = layout(group(page_bytes=4096, layer_names=("a", "b", "c")))
    as_tuple = layout(group(page_bytes=(4096, 4096, 4096), layer_names=("a", "b", "c")))
    assert as_int != as_tuple
    assert as_int.fingerprint == as_tuple.fingerprint
    assert as_int.chunk_nbytes(0) == as_tuple.chunk_nbytes(0)


def test_fingerprint_differs_when_any_per_layer_page_differs():
    base = (41984, 8448, 41984, 8448)
    names = ("a0", "i0", "a1", "i1")
    prints = {base: layout(group(page_bytes=base, layer_names=names)).fingerprint}
    for i in range(len(base)):
        for delta in (-1, 1):
            pages = tuple(p + delta * (j == i) for j, p in enumerate(base))
            prints[pages] = layout(group(page_bytes=pages, layer_names=names)).fingerprint
    swapped = (8448, 41984, 41984, 8448)  # same sizes, other order: other bytes per layer
    prints[swapped] = layout(group(page_bytes=swapped, layer_names=names)).fingerprint
    prints[41984] = layout(group(page_bytes=41984, layer_names=names)).fingerprint
    assert len(set(prints.values())) == len(prints) == 11


def test_int_page_fingerprints_are_unchanged_from_format_1():
    # pinned from the code before per-layer pages and kinds existed: stored chunks stay readable
    tiny = KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=8192, layer_names=("l0", "l2")),
                KVGroup(tokens_per_block=64, page_bytes=8192, layer_names=("l1", "l3"),
                        sliding_window=512)],
        blocks_per_chunk=4, tokens_per_hash=16, model="tiny", dtype="bfloat16")
    assert tiny.fingerprint == "ffaa4300b8e2a6a3c47b8e5252b21f7b4e11cd3bba61239172938ad82bd63055"
    v3 = KVLayout.from_dict(json.loads((LAYOUT_DIR / "deepseek-v3.json").read_text()))
    assert v3.fingerprint == "0ecbd03cb51a7953836df8842cb55395c4b60364236cef3b6ff217eb534300d7"


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_fingerprint_differs_per_kind(kind):
    window = 256 if kind in WINDOWED else None
    others = {k: layout(group(kind=k, sliding_window=256 if k in WINDOWED else None)).fingerprint
              for k in KIND_NAMES if k != kind}
    mine = layout(group(kind=kind, sliding_window=window)).fingerprint
    assert mine not in others.values()


def test_replace_keeps_validation():
    g = group(page_bytes=(64, 32))
    with pytest.raises(ValueError, match=r"\(3 layers\)"):
        dataclasses.replace(g, layer_names=("a", "b", "c"))
