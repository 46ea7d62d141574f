"""Run real vLLM in a child process (tests/vllm/driver.py) and read its JSON answer."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.daemon import DaemonProcess

DRIVER = Path(__file__).parents[1] / "vllm" / "driver.py"
PROMPT_LENGTHS = (600, 650)  # 520..700 tokens: two full chunks of 256 tokens (blocks_per_chunk=2)
MAX_TOKENS = 8
ENGINE_TIMEOUT_S = 240


# Round A computes its prefill while vLLM batches the two prompts as its scheduler sees fit; since
# lookups answer asynchronously (RETRY for one step), A's batch composition depends on timing, and
# the rounds that load (B, X) compute only the tail, in another batch shape. The end-to-end models
# run in float32 (tests/vllm/conftest.py), where that moves a logprob by ~1e-6 (bf16 moved one by
# 3.9e-3 on a loaded CI machine: one ulp of a logit). Rounds that load must agree with each other
# bit for bit; against A they must give the same tokens and logprobs within this bound, and a wrong
# chunk must move them by far more than it.
BATCH_NOISE = 1e-4
WRONG_CHUNK_MIN = 100 * BATCH_NOISE


def worst_difference(got: list[list[float]], want: list[list[float]]) -> float:
    assert [len(x) for x in got] == [len(x) for x in want]
    return max(abs(g - w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))


def assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    worst = worst_difference(got, want)
    assert worst <= BATCH_NOISE, (worst, got, want)


def prompts(seed: int = 1, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def drive(workdir: Path, name: str, **spec) -> dict:
    """Run the driver with ``spec``; its JSON answer, or a failure with the engine's log tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec.setdefault("prompts", prompts())
    spec.setdefault("max_tokens", MAX_TOKENS)
    spec.setdefault("layout_dir", str(workdir / f"layouts-{name}"))
    Path(spec["layout_dir"]).mkdir(exist_ok=True)
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "wb") as log:
        proc = subprocess.run([sys.executable, str(DRIVER), str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S)
    tail = log_path.read_text(errors="replace")[-6000:]
    assert proc.returncode == 0 and out_path.exists(), f"vLLM driver failed:\n{tail}"
    return json.loads(out_path.read_text())


@dataclass
class Scenario:
    kind: str
    first: dict  # instance 1: rounds A (stores), B (loads), C (loads the neighbouring chunk)
    second: dict  # instance 2, a new process on the same daemon: round X
    daemon: DaemonProcess
