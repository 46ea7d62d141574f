"""The GPU path's pure-Python parts, on CPU tensors: tables, batches, launch shape, alignment,
device checks, the HELLO staging field and the errors a machine without CuPy gets."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvtier_client import kernels
from kvtier_client.copies import CopyUnit, build_page_tables
from kvtier_client.cuda_staging import staging_handle, tables_device
from kvtier_client.kernels import (KernelError, build_tables, launch_shape, page_paths, unit_rows,
                                   vector_ok)
from kvtier_client.layout import KVGroup, KVLayout

HAS_CUPY = importlib.util.find_spec("cupy") is not None


def two_group_layout():
    return KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=64, layer_names=("k", "v")),
                            KVGroup(tokens_per_block=32, page_bytes=48, layer_names=("s",))],
                    blocks_per_chunk=(2, 3), tokens_per_hash=16, model="m", dtype="bfloat16")


def test_tables_hold_each_layers_block0_address_and_byte_stride():
    packed = torch.zeros(6, 2, 32, dtype=torch.float16)  # K/V packed: stride(0) = 128 bytes
    split = torch.zeros(6, 25, dtype=torch.float16)[:, 1:]  # starts 2 bytes in, stride 50 bytes
    layout = two_group_layout()
    kv = {"k": packed[:, 0], "v": packed[:, 1], "s": split}
    tables = build_tables(build_page_tables(layout, kv), layout.blocks_per_chunk)
    base = packed.data_ptr()
    # per layer: address, stride, page bytes, offset of its pages in a unit ([layer][block][page])
    assert tables.layers == (base, 128, 64, 0, base + 64, 128, 64, 2 * 64,
                             split.data_ptr(), 50, 48, 0)
    assert tables.groups == (0, 2, 2, 2, 1, 3)
    assert tables.chunk_bytes == (2 * 2 * 64, 3 * 48) and tables.num_layers == (2, 1)


def test_tables_carry_each_layers_own_page_size_and_offset():
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=8, layer_names=("u",)),
                              KVGroup(tokens_per_block=64, page_bytes=(656, 132, 656),
                                      layer_names=("a0", "i0", "a1"), kind="mla")],
                      blocks_per_chunk=3, tokens_per_hash=16, model="m", dtype="fp8_ds_mla")
    kv = {n: torch.zeros(5, 700, dtype=torch.uint8) for n in ("u", "a0", "i0", "a1")}
    tables = build_tables(build_page_tables(layout, kv), layout.blocks_per_chunk)
    rows = [tables.layers[4 * i:4 * i + 4] for i in range(4)]
    assert [(r[2], r[3]) for r in rows] == [(8, 0), (656, 0), (132, 3 * 656), (656, 3 * (656 + 132))]
    assert tables.groups == (0, 1, 3, 1, 3, 3)
    assert tables.chunk_bytes == (24, layout.chunk_nbytes(1)) == (24, 3 * (656 + 132 + 656))
    assert kernels.unit_nbytes(tables, CopyUnit(1, (0, 1, 2), 0)) == layout.chunk_nbytes(1)


def test_unit_rows_pack_units_then_block_ids():
    layout = two_group_layout()
    kv = {n: torch.zeros(8, 64, dtype=torch.uint8) for n in ("k", "v", "s")}
    tables = build_tables(build_page_tables(layout, kv), layout.blocks_per_chunk)
    units = [CopyUnit(1, (4, -1, 2), 0), CopyUnit(0, (7, 1), 256)]
    rows, ids_start, max_pages = unit_rows(tables, units)
    assert rows == [1, 0, 0, 0, 3, 256, 4, -1, 2, 7, 1]
    assert ids_start == 6 and max_pages == 4  # group 0: 2 layers x 2 blocks
    with pytest.raises(ValueError, match="group 0: unit has 3 block ids; allowed: exactly "
                                         "blocks_per_chunk=2"):
        unit_rows(tables, [CopyUnit(0, (1, 2, 3), 0)])


def test_launch_shape_strides_units_past_the_y_limit():
    assert launch_shape(12, 5) == ((12, 5), (kernels.THREADS,))
    assert launch_shape(1, 200_000) == ((1, 65535), (kernels.THREADS,))
    assert launch_shape(0, 0) == ((1, 1), (kernels.THREADS,))


def test_vector_path_needs_source_and_destination_to_agree_mod_16():
    assert vector_ok(0x1000, 0x2000) and vector_ok(0x1003, 0x2013)
    assert not vector_ok(0x1000, 0x2008) and not vector_ok(1, 2)


def test_page_paths_count_vector_and_bytewise_pages():
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=20, layer_names=("x",))],
                      blocks_per_chunk=2, tokens_per_hash=16, model="m", dtype="int8")
    kv = {"x": torch.zeros(4, 32, dtype=torch.uint8)}
    tables = build_tables(build_page_tables(layout, kv), layout.blocks_per_chunk)
    base = kv["x"].data_ptr()
    # staging placed so that block b lands at base-congruent offsets only for the first page
    vec, byte = page_paths(tables, [CopyUnit(0, (0, 1), 0), CopyUnit(0, (2, -1), 64)], base)
    assert (vec, byte) == (2, 1)  # page 2 of unit 0 sits at +20 in staging, block 1 at +32


def test_build_tables_wants_one_blocks_per_chunk_per_group():
    layout = two_group_layout()
    kv = {n: torch.zeros(8, 64, dtype=torch.uint8) for n in ("k", "v", "s")}
    with pytest.raises(ValueError, match="blocks_per_chunk has 1 entries for 2 groups"):
        build_tables(build_page_tables(layout, kv), (2,))


def test_tables_device_cpu_mixed_and_unsupported():
    layout = two_group_layout()
    cpu = {n: torch.zeros(8, 64, dtype=torch.uint8) for n in ("k", "v", "s")}
    assert tables_device(build_page_tables(layout, cpu)) == torch.device("cpu")
    meta = {n: torch.empty(8, 64, dtype=torch.uint8, device="meta") for n in ("k", "v", "s")}
    with pytest.raises(ValueError, match="the KV cache is on meta; allowed: cpu or cuda"):
        tables_device(build_page_tables(layout, meta))
    mixed = {**cpu, "s": meta["s"]}
    with pytest.raises(ValueError, match=r"spans devices \['cpu', 'meta'\]"):
        tables_device(build_page_tables(layout, mixed))


def test_staging_handle_message_format():
    spec = staging_handle(b"\x01" * 64, 1 << 20, 3, "0000:1b:00.0", ticket=b"t" * 16)
    assert spec == {"kind": "cuda_ipc", "ticket": b"t" * 16, "handle": b"\x01" * 64,
                    "nbytes": 1 << 20, "device": 3, "pci_bus_id": "0000:1b:00.0"}
    assert "pci_bus_id" not in staging_handle(b"\x00" * 64, 4096, 0)
    with pytest.raises(ValueError, match="a CUDA IPC handle has 64 bytes"):
        staging_handle(b"\x00" * 63, 4096, 0)


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here: the no-CuPy error cannot happen")
def test_without_cupy_the_gpu_path_says_how_to_get_it():
    with pytest.raises(KernelError, match=r"needs CuPy.*pip install 'kvtierd\[cuda\]'"):
        kernels.load_module(0)
    with pytest.raises(KernelError, match="needs CuPy"):
        kernels.GatherScatter(kernels.KernelTables((), (), (), (), ()), 0)


def test_a_missing_kernel_folder_names_the_setting(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "CUDA_DIR", tmp_path / "nowhere")
    with pytest.raises(KernelError, match="KVTIER_CUDA_DIR"):
        kernels.source()
    monkeypatch.undo()
    assert "kvtier_gather" in kernels.source()
