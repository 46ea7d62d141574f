"""Real vLLM (CPU build) with kvtierd on a recurrent-hybrid model and on a group of mixed page sizes.

* ``qwen3next``: a tiny Qwen3-Next (three Gated DeltaNet state groups + one full-attention group)
  in vLLM's ``mamba_cache_mode="align"``: a state group's chunk is the state at its end, and only
  the last complete one is stored and loaded. vLLM sizes the shared block from the state's bytes,
  which depend on the CPU: 384 tokens where its CPU build keeps the SSM state in float32 for the
  accelerated GDN backend (CPUs with AVX512-BF16), about half that with a bfloat16 state; the
  model's two value heads keep every prompt at two chunks or more either way, so the neighbour
  control swaps chunks of one prompt. The tests read the block vLLM chose from the published
  layout. One sequence at a time (``max_num_seqs=1``): this model must run in bfloat16 (vLLM's
  "CPU GDN attention requires BF16" on such CPUs), where a round that loads, waiting a step for
  its lookups and loads, batched its two prompts otherwise than round A and moved a logprob by one
  ulp of a logit (3.9e-3, as much as a neighbour's chunk); alone, each prompt computes the same
  way in every round.
* ``gemma4-mixed-pages``: the tiny Gemma-4 with the hybrid KV cache manager off: one group whose
  full-attention layers have twice the page bytes of its sliding layers (``UniformTypeKVCacheSpecs``).
  Its prompts end just past 512 tokens, where vLLM's own prefix cache (round L, 128-token blocks)
  and kvtierd (256-token chunks) resume at the same token, so all rounds compute the same split.

Logprobs are compared within ``BATCH_NOISE``, as in the other end-to-end tests: on a CPU with AMX
vLLM's bf16 kernels give results that depend on how a step is batched (one ulp of a logit,
7.8e-3, for Gemma-4's second prompt), so the Gemma-4 case runs in float32, where a second process
batching otherwise moved a logprob by 2.4e-6. On that machine the loads of both cases agreed with
vLLM's own prefix cache bit for bit, and a neighbour's chunk moved a logprob by 3.9e-3
(Qwen3-Next) and 0.25 (Gemma-4).

vLLM 0.32's CPU build cannot run the Mamba2 hybrids (Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1,
Zamba2) with prefix caching: its CPU ``mamba_chunk_scan_combined`` ignores
``return_intermediate_states``, so align mode fails with an IndexError in ``mamba_mixer2``. It runs
DeepSeek-V3.2-style MLA + indexer only with prefix caching forced off (no AMX), so nothing offloads.
"""

from __future__ import annotations

import random

import pytest

from helpers.daemon import DaemonProcess
from helpers.vllm_engine import BATCH_NOISE, assert_close, drive, worst_difference

pytestmark = pytest.mark.vllm
NEIGHBOUR = {"KVTIER_TEST_LOAD_NEIGHBOUR_CHUNK": "1"}
#: A neighbour's chunk must move the logprobs by more than this: well past the noise the loads
#: are allowed (measured: Qwen3-Next 3.9e-3, Gemma-4 0.25).
NEIGHBOUR_MIN = 10 * BATCH_NOISE

CASES = {
    "qwen3next": dict(kind="qwen3next", engine={"mamba_cache_mode": "align", "max_num_seqs": 1},
                      extra_config={"blocks_per_chunk": 1}, lengths=(850, 900), dtype="bfloat16"),
    "gemma4-mixed-pages": dict(kind="gemma4", engine={"disable_hybrid_kv_cache_manager": True},
                               extra_config={"blocks_per_chunk": 2}, lengths=(520, 600),
                               dtype="float32"),
}


def block_tokens(first: dict) -> int:
    """The one block size every group of the published layout has (vLLM's choice)."""
    (layout,) = first["layouts"]
    sizes = {g["tokens_per_block"] for g in layout["groups"]}
    assert len(sizes) == 1, layout["groups"]
    return sizes.pop()


def chunk_tokens(case: dict, first: dict) -> int:
    return block_tokens(first) * case["extra_config"]["blocks_per_chunk"]


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory):
    case = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in case["lengths"]]
    daemon = DaemonProcess(tmp / "daemon", [])
    daemon.start()
    try:
        common = dict(kind=case["kind"], model_dir=str(tmp / "model"), address=daemon.address,
                      engine=case["engine"], extra_config=case["extra_config"], prompts=prompts,
                      dtype=case["dtype"])
        first = drive(tmp, "first", **common, rounds=[
            {"name": "A", "settle": True}, {"name": "L", "reset": False}, {"name": "B"},
            {"name": "C", "env": NEIGHBOUR}])
        stored = daemon.cpu()["chunks"]
        second = drive(tmp, "second", **common, rounds=[{"name": "X"}])
        yield request.param, case, first, second, stored
    finally:
        daemon.stop_and_verify()


def test_loads_from_kvtierd_give_the_tokens_and_logprobs_of_vllms_own_prefix_cache(run):
    name, case, first, second, _ = run
    a, local, b = (first["rounds"][r] for r in "ALB")
    assert local["local_hits"] > 0 and local["external_hits"] == 0, local
    assert b["external_hits"] > 0 and b["local_hits"] == 0, b
    per_chunk = chunk_tokens(case, first)  # every complete chunk of each prompt is loaded
    assert b["num_cached_tokens"] == [n // per_chunk * per_chunk for n in case["lengths"]], (
        b["num_cached_tokens"], per_chunk)
    assert min(b["num_cached_tokens"]) > 0
    assert b["tokens"] == a["tokens"] == local["tokens"]
    assert_close(local["logprobs"], a["logprobs"])
    assert_close(b["logprobs"], a["logprobs"])
    x = second["rounds"]["X"]  # a new vLLM process on the same daemon
    assert x["external_hits"] > 0 and x["local_hits"] == 0, x
    assert x["tokens"] == a["tokens"]
    assert_close(x["logprobs"], a["logprobs"])


def test_loading_neighbouring_chunks_changes_the_logprobs(run):
    _, _, first, _, _ = run
    a, c = first["rounds"]["A"], first["rounds"]["C"]
    assert c["external_hits"] > 0, c
    worst = worst_difference(c["logprobs"], a["logprobs"])
    assert worst > NEIGHBOUR_MIN, (worst, c["logprobs"], a["logprobs"])


def test_the_published_layout_names_vllms_groups_kinds_and_page_sizes(run):
    name, case, first, _, stored = run
    (layout,) = first["layouts"]
    groups = layout["groups"]
    if name == "qwen3next":
        assert [g["kind"] for g in groups] == ["mamba"] * 3 + ["full_attention"], groups
        block = block_tokens(first)
        assert block % 32 == 0, block  # vLLM's CPU attention kernels: a multiple of 32 tokens
        # per prompt: every full-attention chunk, but only the last state of each state group
        full_chunks = sum(n // block for n in case["lengths"])
        assert stored == full_chunks + 3 * len(case["lengths"]), stored
    else:
        (group,) = groups
        assert group["kind"] == "full_attention"  # sliding layers cache every token here
        sliding, full = group["page_bytes"][0], group["page_bytes"][1]
        assert group["page_bytes"] == [sliding, full] * 2 and full == 2 * sliding, group
        assert stored == sum(n // chunk_tokens(case, first) for n in case["lengths"]), stored
