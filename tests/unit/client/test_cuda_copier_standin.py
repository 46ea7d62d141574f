"""The client's CUDA objects on the CPU stand-in for CuPy (control flow, NOT GPU verification):
which device a kernel handle is taken on, what freeing a staging buffer waits for, and when a
staging buffer is retired rather than freed."""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_standin.cupy.cuda import runtime as standin
from helpers.standin import use_standin_cupy
from kvtier_client.copies import build_page_tables
from kvtier_client.cuda_staging import CudaCopier
from kvtier_client.kernels import KERNELS
from kvtier_client.layout import KVGroup, KVLayout


@pytest.fixture
def copier_on(monkeypatch):
    use_standin_cupy(monkeypatch)
    monkeypatch.setenv(standin.DEVICES_ENV, "2")
    made = []

    def make(device: int) -> CudaCopier:
        layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=256,
                                          layer_names=("k", "v"))],
                          blocks_per_chunk=2, tokens_per_hash=16, model="m", dtype="int8")
        kv = {n: torch.randint(0, 256, (8, 256), dtype=torch.uint8) for n in ("k", "v")}
        copier = CudaCopier(build_page_tables(layout, kv), layout.blocks_per_chunk,
                            torch.device("cuda", device))
        made.append(copier)
        return copier

    before = standin.allocated_bytes()
    yield make
    for copier in made:
        copier.close()
    assert standin.allocated_bytes() == before


def test_kernel_handles_are_taken_on_the_clients_device(copier_on):
    copier = copier_on(1)
    assert standin.getDevice() == 0  # the caller's current device is left as it was
    assert {name: fn.device for name, fn in copier.kernels._kernels.items()} == \
        {name: 1 for name in KERNELS}
    assert copier.stream.device == 1


def test_free_waits_for_the_copy_stream_not_the_whole_device(copier_on):
    copier = copier_on(0)
    staging = copier.new_staging(1 << 20)
    device_syncs = standin.calls["deviceSynchronize"]
    waited = copier.stream.synchronized
    staging.free()
    assert standin.calls["deviceSynchronize"] == device_syncs, "stalled every stream"
    assert copier.stream.synchronized == waited + 1
    assert staging.address == 0


def test_a_closed_session_buffer_is_retired_until_the_copier_closes(copier_on):
    copier = copier_on(0)
    before = standin.allocated_bytes()
    staging = copier.new_staging(1 << 20)
    staging.close()  # an abandoned session: the daemon may still copy into it for a while
    assert standin.allocated_bytes() == before + (1 << 20)
    copier.close()
    assert standin.allocated_bytes() == before
