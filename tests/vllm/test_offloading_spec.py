"""Real vLLM (CPU build) with ``KVTierOffloadingSpec`` against a real daemon, three tiny models.

Round A computes and stores; after ``reset_prefix_cache()`` round B must take its prefix from kvtierd
(external hits, no local hits) and give the same tokens and the same logprobs, bit for bit. Round C
loads each chunk from its neighbour's key: its logprobs must change, or the check above proves
nothing. A second vLLM process on the same daemon must hit what the first stored.
"""

from __future__ import annotations

import pytest

# Round A computes its prefill while vLLM batches the two prompts as its scheduler sees fit; since
# lookups answer asynchronously (RETRY for one step), A's batch composition depends on timing, and
# the rounds that load (B, X) compute only the tail, in another batch shape. The models run in
# float32 (conftest), where that moves a logprob by ~1e-6 (bf16 moved one by 3.9e-3 on a loaded CI
# machine: one ulp of a logit). Rounds that load must agree with each other bit for bit; against A
# they must give the same tokens and logprobs within this bound, and a wrong chunk must move them
# by far more than it.
BATCH_NOISE = 1e-4
WRONG_CHUNK_MIN = 100 * BATCH_NOISE


def worst_difference(got: list[list[float]], want: list[list[float]]) -> float:
    assert [len(x) for x in got] == [len(x) for x in want]
    return max(abs(g - w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))


def assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    worst = worst_difference(got, want)
    assert worst <= BATCH_NOISE, (worst, got, want)

MODELS = ["llama", "gemma3", "gemma4"]
pytestmark = [pytest.mark.vllm, pytest.mark.parametrize("scenario", MODELS, indirect=True)]


def test_round_b_takes_its_prefix_from_kvtierd_with_identical_tokens_and_logprobs(scenario):
    a, b = scenario.first["rounds"]["A"], scenario.first["rounds"]["B"]
    assert a["external_hits"] == 0
    assert b["external_hits"] > 0, b
    assert b["local_hits"] == 0, b
    assert all(n >= 512 for n in b["num_cached_tokens"]), b["num_cached_tokens"]
    assert b["tokens"] == a["tokens"]
    assert_close(b["logprobs"], a["logprobs"])


def test_loading_a_neighbouring_chunk_changes_the_logprobs(scenario):
    a, c = scenario.first["rounds"]["A"], scenario.first["rounds"]["C"]
    assert c["external_hits"] > 0, c
    worst = worst_difference(c["logprobs"], a["logprobs"])
    assert worst > WRONG_CHUNK_MIN, (worst, c["logprobs"], a["logprobs"])


def test_a_second_instance_hits_what_the_first_stored(scenario):
    a, x = scenario.first["rounds"]["A"], scenario.second["rounds"]["X"]
    assert x["external_hits"] > 0, x
    assert x["local_hits"] == 0, x
    assert x["tokens"] == a["tokens"]
    assert_close(x["logprobs"], a["logprobs"])
    assert x["logprobs"] == scenario.first["rounds"]["B"]["logprobs"]  # both loaded: bit for bit


def test_each_group_is_chunked_by_its_own_tokens_per_block(scenario):
    (layout,) = scenario.first["layouts"]
    tpb = sorted(g["tokens_per_block"] for g in layout["groups"])
    expected = {"llama": [128], "gemma3": [128, 128], "gemma4": [128, 256]}[scenario.kind]
    assert tpb == expected, layout
    assert layout["blocks_per_chunk"] == 2
    stored = scenario.daemon.cpu()["chunks"]
    assert stored > 0
