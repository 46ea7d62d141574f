"""The README's first command runs `kvtierd demo`: it must start a daemon, verify, and clean up."""

import subprocess
import sys
from pathlib import Path


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
    for model, tokens_per_chunk in (("gemma-4-31b-demo", {128, 256}),
                                    ("deepseek-v4-flash-demo", {512, 128, 8, 16})):
        rows = [line.split() for line in out.splitlines() if line.startswith(model)]
        assert {int(r[4]) for r in rows if len(r) == 9} == tokens_per_chunk, out
    assert "/metrics" in out
    assert not sock.exists(), "daemon left its socket behind"
    assert "Traceback" not in result.stderr


def test_demo_fails_when_daemon_cannot_start(tmp_path):
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "kvtierd", "demo", "--socket", f"ipc://{bad}/d.sock",
         "--metrics-addr", "off", "--nvme-bytes", "0"], capture_output=True, text=True,
        timeout=120)
    assert result.returncode != 0
    assert not Path(f"{bad}/d.sock").exists()
