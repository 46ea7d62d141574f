"""End-to-end fixtures: a real ``kvtierd serve`` per model and real vLLM in child processes."""

from __future__ import annotations

import pytest

from helpers.daemon import DaemonProcess
from helpers.vllm_engine import PROMPT_LENGTHS, Scenario, drive, prompts

# Full-attention-only llama: with two chunks per prompt, loading each from its neighbour's key only
# swaps them, and attention over a swapped set of (RoPE-encoded) keys is the same sum; three full
# chunks (768 of 800 tokens) make the neighbour control a real corruption. Gemma-4's sliding group
# chunks 512 tokens: at 800 tokens its first chunk has left the window before vLLM stores it, so
# the Gemma models keep two chunks per prompt.
LENGTHS = {"llama": (800, 850)}


@pytest.fixture(scope="module")
def scenario(request, tmp_path_factory) -> Scenario:
    """One tiny model, one daemon, two vLLM instances one after the other."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    daemon = DaemonProcess(tmp / "daemon", [])
    daemon.start()
    try:
        # float32: the rounds that compute (A) and those that load (B, X) run in different batch
        # shapes, and in bf16 one ulp of a logit (~4e-3) is within reach of that; float32 keeps
        # that noise near 1e-6, far below both BATCH_NOISE and what a wrong chunk does
        common = dict(kind=kind, model_dir=str(tmp / "model"), address=daemon.address,
                      dtype="float32", prompts=prompts(lengths=LENGTHS.get(kind, PROMPT_LENGTHS)))
        first = drive(tmp, "first", **common, rounds=[
            {"name": "A", "settle": True}, {"name": "B"},
            {"name": "C", "env": {"KVTIER_TEST_LOAD_NEIGHBOUR_CHUNK": "1"}}])
        second = drive(tmp, "second", **common, rounds=[{"name": "X"}])
        yield Scenario(kind, first, second, daemon)
    finally:
        daemon.stop_and_verify()
