"""Which CUDA failures lose a device for good, and the allocation size query, on the CPU stand-in
for CuPy (``tests/helpers/cuda_standin``: control flow, not GPU verification)."""

from __future__ import annotations

import pytest

from helpers.cuda_standin import cupy as standin_cupy
from helpers.cuda_standin.cupy.cuda import runtime as standin
from kvtierd import cuda_health


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(cuda_health, "_lost", {})


def test_a_sticky_error_loses_the_device_and_every_later_copy_is_refused():
    lost = cuda_health.note_failure(standin_cupy, 0, standin.CUDARuntimeError(700))
    assert isinstance(lost, cuda_health.CudaContextLost)
    assert "cudaErrorIllegalAddress (700)" in str(lost)
    assert cuda_health.any_lost() and cuda_health.lost() == {0: "cudaErrorIllegalAddress (700)"}
    with pytest.raises(cuda_health.CudaContextLost, match="device 0 was lost earlier"):
        cuda_health.check_device(0)
    cuda_health.check_device(1)  # another device is not affected


def test_an_error_the_context_survives_fails_only_that_call():
    assert cuda_health.note_failure(standin_cupy, 0, standin.CUDARuntimeError(1)) is None
    assert not cuda_health.any_lost()


def test_an_unknown_error_after_which_the_context_no_longer_answers_is_sticky(monkeypatch):
    monkeypatch.setitem(standin._state, "broken", 999)  # every call fails from now on
    lost = cuda_health.note_failure(standin_cupy, 0, standin.CUDARuntimeError(999))
    assert lost is not None and "no longer answers" in str(lost)
    assert 0 in cuda_health.lost()


def test_allocation_range_reports_the_allocation_or_a_driver_error():
    ptr = standin.malloc(1 << 16)
    try:
        assert cuda_health.allocation_range(standin_cupy, ptr + 100) == (ptr, 1 << 16)
    finally:
        standin.free(ptr)
    with pytest.raises(cuda_health.DriverError, match="cuMemGetAddressRange"):
        cuda_health.allocation_range(standin_cupy, ptr)
