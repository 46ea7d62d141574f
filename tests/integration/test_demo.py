"""The README's first command runs `kvtierd demo`: it must start a daemon, verify, and clean up."""

import subprocess
import sys
from pathlib import Path

from kvtier_client import KVLayout
from kvtierd.demo import DEEPSEEK_V4_FLASH_LIKE, GEMMA4_LIKE, one_block_size


def test_demo_starts_daemon_verifies_and_stops(tmp_path):
    sock = tmp_path / "demo.sock"
    result = subprocess.run(
        [sys.executable, "-m", "kvtierd", "demo", "--socket", f"ipc://{sock}",
         "--metrics-addr", "127.0.0.1:0", "--cpu-bytes", "256MiB", "--tokens", "1500",
         "--nvme-dir", str(tmp_path / "nvme"), "--nvme-bytes", "256MiB",
         "--requests", "2"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("byte-exact") == 2, out
    # both mixed-group layouts appear with their per-group tokens per chunk
    for model, tokens_per_chunk, reader_block_size in (
            ("gemma-4-31b-demo", {128, 256}, 16),
            ("deepseek-v4-flash-demo", {512, 128, 8, 16}, 256)):
        rows = [line.split() for line in out.splitlines() if line.startswith(model)]
        groups = [r for r in rows if len(r) == 10]
        assert {int(r[4]) for r in groups} == tokens_per_chunk, out
        # every stored chunk was found by LOOKUP and filled by the load
        assert all(int(r[5]) > 0 and r[5] == r[8] == r[9] for r in groups), out
        # the reader chunking every group by one block size found none of the same prompts
        wrong = [r for r in rows if r[-4:] == ["miss,", "never", "wrong", "bytes"]]
        assert len(wrong) == 1, out
        assert int(wrong[0][1]) == reader_block_size and int(wrong[0][2]) > 0, out
        assert wrong[0][3] == "0", out
    assert "/metrics" in out
    assert not sock.exists(), "daemon left its socket behind"
    assert "Traceback" not in result.stderr


def test_one_block_size_puts_every_group_at_the_first_groups_block_size():
    for spec in (GEMMA4_LIKE, DEEPSEEK_V4_FLASH_LIKE):
        wrong = one_block_size(spec)
        first = spec["groups"][0]["tokens_per_block"]
        assert [g["tokens_per_block"] for g in wrong["groups"]] == [first] * len(spec["groups"])
        assert KVLayout.from_dict(wrong).fingerprint != KVLayout.from_dict(spec).fingerprint
        # the spec the writer uses is left as it was
        assert len({g["tokens_per_block"] for g in spec["groups"]}) > 1


def test_demo_fails_when_daemon_cannot_start(tmp_path):
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "kvtierd", "demo", "--socket", f"ipc://{bad}/d.sock",
         "--metrics-addr", "off", "--nvme-bytes", "0"], capture_output=True, text=True,
        timeout=120)
    assert result.returncode != 0
    assert not Path(f"{bad}/d.sock").exists()
