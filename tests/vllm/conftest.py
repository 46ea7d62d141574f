"""End-to-end fixtures: a real ``kvtierd serve`` per model and real vLLM in child processes."""

from __future__ import annotations

import pytest

from helpers.daemon import DaemonProcess
from helpers.vllm_engine import Scenario, drive


@pytest.fixture(scope="module")
def scenario(request, tmp_path_factory) -> Scenario:
    """One tiny model, one daemon, two vLLM instances one after the other."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    daemon = DaemonProcess(tmp / "daemon", [])
    daemon.start()
    try:
        common = dict(kind=kind, model_dir=str(tmp / "model"), address=daemon.address)
        first = drive(tmp, "first", **common, rounds=[
            {"name": "A", "settle": True}, {"name": "B"},
            {"name": "C", "env": {"KVTIER_TEST_LOAD_NEIGHBOUR_CHUNK": "1"}}])
        second = drive(tmp, "second", **common, rounds=[{"name": "X"}])
        yield Scenario(kind, first, second, daemon)
    finally:
        daemon.stop_and_verify()
