"""The CUDA kernels without a GPU: every cuda/*.cu compiles with nvcc, and the kernels' own page
logic (compiled for the host from the same source) matches the torch reference byte for byte.

The host harness runs every CUDA block and thread of the launch grid that ``kernels.launch_shape``
gives, over tables built by ``kernels.build_tables``/``unit_rows`` from real CPU tensors: the
index arithmetic, the 16-byte/byte-wise choice, heads and tails are the GPU's code. What only a GPU
checks (tests/gpu/): NVRTC through CuPy, real launches, device memory, concurrency.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.kv import LAYOUT_FILES, load_layout
from kvtier_client.copies import CopyUnit, build_page_tables, gather, scatter
from kvtier_client.kernels import (CUDA_DIR, THREADS, build_tables, launch_shape, page_paths,
                                   unit_rows)
from kvtier_client.layout import KVGroup, KVLayout

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit absent); "
                                "CI machines have it")
HARNESS = Path(__file__).parent / "kernel_harness.cu"
POISON = 0xAB
GEN = torch.Generator().manual_seed(11)


@needs_nvcc
@pytest.mark.parametrize("source", sorted(CUDA_DIR.glob("*.cu")), ids=lambda p: p.name)
def test_every_kernel_source_compiles_to_ptx_for_hopper(source, tmp_path):
    out = tmp_path / (source.stem + ".ptx")
    proc = subprocess.run([NVCC, "-ptx", "-arch=sm_90", "-std=c++14", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ptx = out.read_text()
    if source.name == "gather_scatter.cu":
        assert ".entry kvtier_gather(" in ptx and ".entry kvtier_scatter(" in ptx
        assert "ld.v4.u32" in ptx or "ld.global.v4.u32" in ptx, "no 16-byte loads in the PTX"


@pytest.fixture(scope="module")
def emulate(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH (CUDA toolkit absent); CI machines have it")
    lib = tmp_path_factory.mktemp("harness") / "harness.so"
    proc = subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-O1", f"-I{CUDA_DIR}",
                           str(HARNESS), "-o", str(lib)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    fn = ctypes.CDLL(str(lib)).kvt_emulate
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_longlong, ctypes.c_int] + [ctypes.c_longlong] * 3

    def run(page_tables, bpc, units, staging, to_staging, threads=THREADS):
        tables = build_tables(page_tables, bpc)
        rows, ids_start, max_pages = unit_rows(tables, units)
        layers = torch.tensor(tables.layers, dtype=torch.int64)
        groups = torch.tensor(tables.groups, dtype=torch.int64)
        packed = torch.tensor(rows, dtype=torch.int64)
        (gx, gy), _ = launch_shape(max_pages, len(units))
        fn(layers.data_ptr(), groups.data_ptr(), packed.data_ptr(),
           packed.data_ptr() + 8 * ids_start, staging.data_ptr(), len(units), int(to_staging),
           gx, gy, threads)
        return tables

    return run


def random_storage(shape, dtype=torch.uint8):
    """A contiguous tensor whose every byte is random (no NaN worries: compared as bytes)."""
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=GEN)
    return raw.view(dtype).view(shape)


def check_both_ways(emulate, layout, kv, units, staging_bytes, staging_base=0, threads=THREADS):
    """Gather with the harness and with torch into poisoned staging; compare. Then scatter both
    ways into poisoned copies of the cache and compare every byte of every storage."""
    bpc = layout.blocks_per_chunk
    ref = torch.full((staging_bytes + staging_base,), POISON, dtype=torch.uint8)
    got = ref.clone()
    gather(build_page_tables(layout, kv), units, ref[staging_base:])
    emulate(build_page_tables(layout, kv), bpc, units, got[staging_base:], True, threads)
    assert torch.equal(got, ref), "gather differs from the torch reference"

    def poisoned():
        out = {}
        for name, t in kv.items():
            raw = torch.full((t.untyped_storage().nbytes(),), POISON, dtype=torch.uint8)
            out[name] = torch.empty(0, dtype=t.dtype).set_(
                raw.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        return out

    kv_ref, kv_got = poisoned(), poisoned()
    scatter(build_page_tables(layout, kv_ref), units, ref[staging_base:])
    emulate(build_page_tables(layout, kv_got), bpc, units, got[staging_base:], False, threads)
    for name in kv:
        a = kv_ref[name].untyped_storage()
        b = kv_got[name].untyped_storage()
        assert bytes(a) == bytes(b), f"scatter differs in layer {name}"


def random_units(layout, num_blocks, count, gen, minus_one=0.0, align=256, start=0):
    units, offset = [], start
    offloadable = [g for g, ok in enumerate(layout.offloadable) if ok]
    for i in range(count):
        g = offloadable[i % len(offloadable)]
        ids = torch.randperm(num_blocks[g], generator=gen)[:layout.blocks_per_chunk[g]].tolist()
        ids = [-1 if torch.rand(1, generator=gen).item() < minus_one else b for b in ids]
        units.append(CopyUnit(g, tuple(ids), offset))
        offset += layout.chunk_nbytes(g)
        offset = -(-offset // align) * align
    return units, offset


@pytest.mark.parametrize("path", LAYOUT_FILES, ids=lambda p: p.stem)
def test_reference_layouts_match_torch(emulate, path):
    layout = load_layout(path, page_bytes=544, layers_per_group=2)
    blocks = [max(layout.blocks_per_chunk[g] * 3, 4) for g in range(len(layout.groups))]
    kv = {name: random_storage((blocks[g], page + 3)) for g, gr in enumerate(layout.groups)
          for name, page in zip(gr.layer_names, gr.layer_page_bytes)}  # 3 padding bytes a block
    units, end = random_units(layout, blocks, 7, GEN, minus_one=0.2)
    check_both_ways(emulate, layout, kv, units, end + 512)


@pytest.mark.parametrize("page", [1, 13, 15, 16, 17, 100, 4095, 4097, 5000])
@pytest.mark.parametrize("align", [1, 16, 256])
def test_odd_pages_and_staging_offsets(emulate, page, align):
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=page, layer_names=("a", "b"))],
                      blocks_per_chunk=3, tokens_per_hash=16, model="m", dtype="int8")
    kv = {"a": random_storage((9, page + 3)), "b": random_storage((9, page))}
    units, end = random_units(layout, [9], 4, GEN, minus_one=0.15, align=align, start=align % 7)
    check_both_ways(emulate, layout, kv, units, end + 64)


@pytest.mark.parametrize("threads", [1, 7, THREADS])
@pytest.mark.parametrize("align", [1, 16, 256])
def test_per_layer_page_sizes_match_torch(emulate, align, threads):
    # DeepSeek-V3.2-like: MLA latents and indexer caches in one group, each with its own page
    # size (odd ones too), beside a uniform group; padded and offset tensors, -1 blocks
    pages = (656, 132, 657, 17, 4096)
    layout = KVLayout(
        groups=[KVGroup(tokens_per_block=64, page_bytes=pages, kind="mla",
                        layer_names=tuple(f"m{i}" for i in range(len(pages)))),
                KVGroup(tokens_per_block=16, page_bytes=(100, 100), layer_names=("u0", "u1"))],
        blocks_per_chunk=(3, 2), tokens_per_hash=16, model="m", dtype="fp8_ds_mla")
    kv = {f"m{i}": random_storage((8, page + 5))[:, i % 3:i % 3 + page]
          for i, page in enumerate(pages)}
    kv |= {"u0": random_storage((6, 100)), "u1": random_storage((6, 2, 100))[:, 1]}
    units, end = random_units(layout, [8, 6], 9, GEN, minus_one=0.15, align=align, start=align % 5)
    check_both_ways(emulate, layout, kv, units, end + 64, threads=threads)
    tables = build_tables(build_page_tables(layout, kv), layout.blocks_per_chunk)
    assert [tables.layers[4 * i + 2] for i in range(7)] == [*pages, 100, 100]


def test_packed_and_split_kv_strided_views_bf16(emulate):
    # vLLM-like: K and V packed in one [blocks, 2, tokens, heads, dim] tensor (stride(0) = 2 pages)
    packed = random_storage((10, 2, 4, 2, 8), torch.bfloat16)
    split_k = random_storage((10, 4, 2, 8), torch.bfloat16)
    padded = random_storage((10, 80), torch.bfloat16)[:, 3:67]  # misaligned start, padded stride
    layout = KVLayout(
        groups=[KVGroup(tokens_per_block=4, page_bytes=128, layer_names=("k", "v")),
                KVGroup(tokens_per_block=8, page_bytes=128, layer_names=("s", "p"))],
        blocks_per_chunk=(2, 3), tokens_per_hash=4, model="m", dtype="bfloat16")
    kv = {"k": packed[:, 0], "v": packed[:, 1], "s": split_k, "p": padded}
    assert kv["k"].stride(0) * 2 == 256 and kv["p"].storage_offset() == 3
    units = [CopyUnit(0, (7, -1), 0), CopyUnit(1, (9, 0, 4), 512), CopyUnit(0, (1, 8), 1280),
             CopyUnit(1, (-1, 2, 5), 1792)]
    check_both_ways(emulate, layout, kv, units, 2560)
    tables = build_tables(build_page_tables(layout, kv), layout.blocks_per_chunk)
    vec, byte = page_paths(tables, units, 0)
    assert vec > 0 and byte > 0  # the padded layer's pages (start at +6 bytes) go byte-wise


def test_units_beyond_the_grid_y_limit_are_strided(emulate):
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=32, layer_names=("x",))],
                      blocks_per_chunk=1, tokens_per_hash=16, model="m", dtype="int8")
    kv = {"x": random_storage((50, 32))}
    units = [CopyUnit(0, (i % 50,), 32 * i) for i in range(70_000)]
    ref = torch.full((32 * 70_000,), POISON, dtype=torch.uint8)
    got = ref.clone()
    gather(build_page_tables(layout, kv), units, ref)
    emulate(build_page_tables(layout, kv), layout.blocks_per_chunk, units, got, True, threads=4)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("threads", [1, 3, 32, 256, 1024])
def test_any_thread_count_covers_every_byte(emulate, threads):
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=1000, layer_names=("x",))],
                      blocks_per_chunk=2, tokens_per_hash=16, model="m", dtype="int8")
    kv = {"x": random_storage((6, 1024))}
    units = [CopyUnit(0, (5, 1), 0), CopyUnit(0, (0, -1), 2000), CopyUnit(0, (2, 3), 4003)]
    check_both_ways(emulate, layout, kv, units, 6100, threads=threads)
