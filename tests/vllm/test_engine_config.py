"""Engine-level configuration: vLLM's legacy ``block_size`` key vs ``blocks_per_chunk`` on Gemma-4,
and an engine whose daemon is down keeps serving."""

from __future__ import annotations

import pytest

from helpers.vllm_engine import assert_close, drive

pytestmark = pytest.mark.vllm


def test_gemma4_legacy_block_size_key_is_refused(tmp_path):
    # Gemma-4 groups have 256 and 128 tokens per block: one model-wide block size cannot chunk
    # both, so vLLM refuses it (blocks_per_chunk works: see test_offloading_spec).
    out = drive(tmp_path, "legacy", kind="gemma4", model_dir=str(tmp_path / "model"),
                address=f"ipc://{tmp_path}/none.sock", extra_config={"block_size": 256},
                rounds=[{"name": "A"}])
    assert "refused" in out, out
    assert "same block size" in out["refused"], out["refused"]


def test_engine_keeps_serving_when_the_daemon_is_down(tmp_path):
    # float32 and BATCH_NOISE, as in tests/vllm/conftest.py: the two rounds may batch their
    # prompts differently (their lookups fail at their own pace), which in bf16 on a CPU with AMX
    # moved a logprob by 1.2e-6 (it failed the exact comparison once in three full runs)
    out = drive(tmp_path, "down", kind="llama", model_dir=str(tmp_path / "model"),
                address=f"ipc://{tmp_path}/nobody-listens.sock", dtype="float32",
                rounds=[{"name": "A"}, {"name": "B"}])
    a, b = out["rounds"]["A"], out["rounds"]["B"]
    assert a["external_hits"] == b["external_hits"] == 0
    assert b["tokens"] == a["tokens"]
    assert_close(b["logprobs"], a["logprobs"])
    assert b["seconds"] < 30, "a down daemon must cost misses, not hung steps"


def test_kvtier_connector_hands_failed_loads_to_vllms_recompute(tmp_path, daemon_factory):
    # The chunks vanish between lookup and load (test switch: as if evicted), so every load fails;
    # with KVTierConnector and kv_load_failure_policy=recompute vLLM recomputes those blocks. The
    # second engine is a fresh process: its blocks never held this prompt's KV. float32, as in
    # tests/vllm/conftest.py: the recompute runs the prefill in other batch shapes than round A,
    # and in bf16 that moved one logprob by one ulp of a logit (3.9e-3) on some machines.
    daemon = daemon_factory()
    common = dict(kind="llama", model_dir=str(tmp_path / "model"), address=daemon.address,
                  dtype="float32",
                  connector={"kv_connector": "KVTierConnector",
                             "kv_connector_module_path": "kvtier_client.vllm",
                             "kv_load_failure_policy": "recompute"})
    a = drive(tmp_path, "store", **common, rounds=[{"name": "A", "settle": True}])["rounds"]["A"]
    f = drive(tmp_path, "fail", **common, rounds=[
        {"name": "F", "env": {"KVTIER_TEST_DROP_BEFORE_LOAD": "1"}}])["rounds"]["F"]
    assert f["external_hits"] > 0  # the scheduler counted on kvtierd, the loads then failed
    assert f["tokens"] == a["tokens"]
    assert_close(f["logprobs"], a["logprobs"])
