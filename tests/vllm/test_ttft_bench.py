"""``benchmarks/vllm_ttft.py --quick`` end to end: real vLLM (CPU build) with and without kvtierd
on a tiny model. A smoke test of the script and its output, never of its timings; it does check
that kvtierd really served prefixes (a benchmark whose kvtierd row saves nothing measures nothing).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(420)]


def test_quick_run_reports_ttft_and_saved_prefill_for_every_configuration(tmp_path):
    out = tmp_path / "ttft.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_ttft.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "TTFT mean" in done.stdout and "vLLM block" in done.stdout, done.stdout[-2000:]
    table = json.loads(out.read_text())["table"]
    assert set(table) == {"vllm", "kvtierd", "vllm-native-cpu"}
    for workload in ("documents", "chat"):
        plain, ours = table["vllm"][workload], table["kvtierd"][workload]
        assert plain["saved"] == 0 and plain["computed_tokens"] == plain["prompt_tokens"]
        assert ours["prompt_tokens"] == plain["prompt_tokens"]
        assert 0.5 < ours["saved"] < 1 and ours["computed_tokens"] < plain["computed_tokens"]
        assert ours["ttft_mean_s"] > 0 and ours["ttft_p50_s"] > 0
    native = table["vllm-native-cpu"]  # the CPU build refuses it today; either way, reported
    assert "refused" in native or native["documents"]["ttft_mean_s"] > 0
