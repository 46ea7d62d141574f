"""The device scripts on a machine without a GPU: they must say that nothing was verified and fail,
never pass; ``--fetch-wheels`` reports pip's failure. (On a GPU they are the verification.)"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_usable() -> bool:
    try:
        import cupy  # noqa: PLC0415 - optional
    except ImportError:
        return False
    try:
        return not getattr(cupy, "STANDIN", False) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver
        return False


needs_no_gpu = pytest.mark.skipif(gpu_usable(), reason="a GPU is usable here: gpu_check.sh "
                                                       "really runs")


def run(args: list[str], env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@needs_no_gpu
def test_gpu_check_without_a_gpu_fails_saying_nothing_was_verified(tmp_path):
    done = run(["bash", "benchmarks/gpu_check.sh"], env={"OUT": str(tmp_path)})
    assert done.returncode == 3, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: no GPU: nothing verified ("), done.stdout
    assert "== gpu_check summary" in done.stdout


@needs_no_gpu
def test_gpu_check_refuses_the_cpu_stand_in_as_a_gpu(tmp_path):
    standin = str(ROOT / "tests" / "helpers" / "cuda_standin")
    done = run(["bash", "benchmarks/gpu_check.sh"], env={"OUT": str(tmp_path),
                                                          "PYTHONPATH": standin})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no GPU: nothing verified (CuPy is the CPU stand-in" in done.stdout


def test_fetch_wheels_exits_with_pips_status(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "gpu_check.sh", tmp_path / "benchmarks")
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "old.whl").write_bytes(b"x")  # an `ls` of it would succeed
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "",
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple/", "PIP_RETRIES": "0",
           "PIP_DEFAULT_TIMEOUT": "2", "WHEEL_PYTHONS": "3.12"}
    done = run(["bash", "benchmarks/gpu_check.sh", "--fetch-wheels"], env=env, cwd=tmp_path)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "pip download for CPython 3.12 failed" in done.stderr


@needs_no_gpu
def test_preflight_without_cupy_fails_with_its_table(tmp_path):
    done = run([sys.executable, "benchmarks/gpu_preflight.py", "--json", str(tmp_path / "p.json")])
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "preflight: FAIL"
    assert any(line.startswith("CuPy and a GPU") and " FAIL " in line for line in lines), lines


def load_preflight():
    spec = importlib.util.spec_from_file_location("gpu_preflight",
                                                  ROOT / "benchmarks" / "gpu_preflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preflight_ipc_checks_run_their_course_on_the_cpu_stand_in(monkeypatch):
    """The preflight's IPC rows (a child exporting, open twice, SIGKILL, D2H after it) walk their
    whole control flow on the stand-in, so the device run cannot lose them to a plain bug. What
    they answer here is the stand-in's, not a GPU's."""
    from helpers.cuda_standin import cupy as standin_cupy  # noqa: PLC0415

    standin = str(ROOT / "tests" / "helpers" / "cuda_standin")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (standin, os.environ.get("PYTHONPATH")) if p))  # the exporting child's cupy
    preflight = load_preflight()
    exporter = preflight.Exporter(1 << 20)
    state: dict = {}
    try:
        opened = preflight.ipc_open(standin_cupy, exporter, state)
        assert "bytes match" in opened and "second open of the same handle returns" in opened
        after = preflight.after_sigkill(standin_cupy, exporter, state)
        assert after.startswith("after SIGKILL of the exporter a D2H reads the child's bytes")
        assert after.endswith("context healthy")
    finally:
        exporter.kill()
        exporter.proc.stdin.close()
        exporter.proc.stdout.close()
