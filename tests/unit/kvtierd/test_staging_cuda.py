"""CUDA IPC staging, the parts a machine without a GPU checks: the HELLO field, the DMA plan
(contiguous arena runs merged, cut at pinned pieces), bounds, and the no-CUDA refusal."""

from __future__ import annotations

import pytest

from kvtierd import staging_cuda
from kvtierd.protocol import ProtocolError, Status
from kvtierd.staging_cuda import CudaIpcStaging, check_range, copy_plan, parse_spec

GOOD = {"kind": "cuda_ipc", "handle": bytes(range(64)), "nbytes": 1 << 20, "device": 1}


def test_parse_spec_accepts_the_client_format():
    assert parse_spec(GOOD, 1 << 30) == (bytes(range(64)), 1 << 20, 1, None)
    assert parse_spec({**GOOD, "pci_bus_id": "0000:1b:00.0"}, 1 << 30)[3] == "0000:1b:00.0"


@pytest.mark.parametrize("change, match", [
    ({"handle": b"\x00" * 63}, "must be 64 bytes"),
    ({"handle": "x" * 64}, "must be 64 bytes"),
    ({"nbytes": 0}, r"nbytes 0 must be an int in 1\.\.1024"),
    ({"nbytes": 4096}, r"in 1\.\.1024"),
    ({"nbytes": True}, "nbytes True"),
    ({"device": -1}, "device -1 must be an int >= 0"),
    ({"device": None}, "device None"),
    ({"pci_bus_id": 7}, "pci_bus_id 7"),
])
def test_parse_spec_refuses_bad_fields(change, match):
    spec = {**GOOD, "nbytes": 512, **change}
    with pytest.raises(ProtocolError, match=match) as err:
        parse_spec(spec, 1024)
    assert err.value.status is Status.BAD_HANDLE


def test_copy_plan_merges_adjacent_runs_and_keeps_staging_contiguous():
    segs = [(0, 100), (100, 50), (400, 10), (410, 5), (1000, 7)]
    assert copy_plan(64, segs) == [(64, 0, 150), (214, 400, 15), (229, 1000, 7)]
    assert copy_plan(0, []) == []


def test_copy_plan_cuts_at_pinned_piece_boundaries():
    assert copy_plan(0, [(90, 30), (120, 200)], piece_bytes=100) == [
        (0, 90, 10), (10, 100, 100), (110, 200, 100), (210, 300, 20)]


def test_check_range():
    assert check_range(0, 10, 10) is None
    assert "outside the staging buffer [0, 10)" in check_range(5, 6, 10)
    assert "must be ints" in check_range("0", 1, 10)


@pytest.mark.skipif(staging_cuda.unavailable_reason() is None,
                    reason="this machine has CUDA: the no-CUDA refusal cannot happen")
def test_a_daemon_without_cuda_refuses_with_the_reason():
    with pytest.raises(ProtocolError, match=r"needs a daemon with CUDA; this one has none "
                                            r"\(.+\): use 'memfd' staging") as err:
        CudaIpcStaging(GOOD, 1 << 30)
    assert err.value.status is Status.BAD_HANDLE
    assert staging_cuda.stats() == {"open_handles": 0, "opened_total": 0}
