"""The GPU gather/scatter kernels (``cuda/gather_scatter.cu``): tables, loading and launching.

The kernels copy, in one launch per batch, every unit's pages between the paged KV cache and the
staging buffer with exactly the torch reference's semantics (``copies.py``). What they need is
computed here as plain Python ints, so that it can be checked on a machine without a GPU:

* ``build_tables(page_tables)``: per global layer ``(base address, block stride in bytes, page
  bytes, offset of its pages in a unit)`` and per group ``(first layer, layers, blocks_per_chunk)``,
  from each layer's byte-page view (its ``data_ptr()`` is block 0's address, its ``stride(0)`` the
  block stride in bytes, its width the layer's own page size: a group may mix page sizes);
* ``unit_rows(tables, units)``: per unit ``(group, first block-id index, staging offset)`` and the
  flat block-id array, packed into one int64 array (one host → device copy per batch);
* ``launch_shape``: grid ``(pages of the largest unit, units)`` and threads per block.

``load_module()`` compiles the source once per process with NVRTC through ``cupy.RawModule`` (CuPy
caches the binary on disk too) and raises ``KernelError`` saying what is missing when CuPy, NVRTC,
the driver or a GPU is not there.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .copies import CopyUnit, LayerPages

#: Where the .cu sources live: $KVTIER_CUDA_DIR, else ``cuda/`` beside the ``client/`` folder.
CUDA_DIR = Path(os.environ.get("KVTIER_CUDA_DIR", Path(__file__).resolve().parent.parent / "cuda"))
SOURCE = "gather_scatter.cu"
KERNELS = ("kvtier_gather", "kvtier_scatter")
VECTOR_BYTES = 16  # the kernels' vector width: a page takes it when src ≡ dst (mod 16)
THREADS = 256  # threads per CUDA block; each CUDA block copies whole pages
MAX_GRID_Y = 65535  # CUDA's limit; the kernels stride over units beyond it
UNIT_FIELDS = 3  # group, first block-id index, staging offset
LAYER_FIELDS = 4  # base address, block stride, page_bytes, offset of the layer's pages in a unit
GROUP_FIELDS = 3  # first layer, layers, blocks_per_chunk


class KernelError(RuntimeError):
    """The GPU kernels cannot be used here; the message says what is missing and what to do."""


@dataclass(frozen=True)
class KernelTables:
    """The static device tables of one client: flat int64 rows (see ``cuda/gather_scatter.cu``)."""

    layers: tuple[int, ...]  # per global layer: base, block stride, page_bytes, offset in a unit
    groups: tuple[int, ...]  # per group: first layer, layers, blocks_per_chunk
    blocks_per_chunk: tuple[int, ...]
    chunk_bytes: tuple[int, ...]  # per group: bytes of one unit (blocks_per_chunk * its pages)
    num_layers: tuple[int, ...]


def layer_row(layer: LayerPages) -> tuple[int, int]:
    """``(address of block 0, block stride in bytes)`` of a layer's ``[blocks, page]`` byte view."""
    pages = layer.pages
    return pages.data_ptr(), pages.stride(0) * pages.element_size()


def build_tables(page_tables: Sequence[Sequence[LayerPages]],
                 blocks_per_chunk: Sequence[int]) -> KernelTables:
    """Flatten per-group layer pages (``copies.build_page_tables``) into the kernels' tables."""
    if len(blocks_per_chunk) != len(page_tables):
        raise ValueError(f"blocks_per_chunk has {len(blocks_per_chunk)} entries for "
                         f"{len(page_tables)} groups; allowed: one per group")
    layers: list[int] = []
    groups: list[int] = []
    chunk_bytes: list[int] = []
    first = 0
    for group_layers, bpc in zip(page_tables, blocks_per_chunk):
        offset = 0  # [layer][block][page]: a layer's pages follow the earlier layers' in the unit
        for layer in group_layers:
            page = layer.pages.shape[1]
            layers.extend((*layer_row(layer), page, offset))
            offset += bpc * page
        groups.extend((first, len(group_layers), bpc))
        chunk_bytes.append(offset)
        first += len(group_layers)
    return KernelTables(tuple(layers), tuple(groups), tuple(blocks_per_chunk), tuple(chunk_bytes),
                        tuple(len(g) for g in page_tables))


def unit_rows(tables: KernelTables, units: Sequence[CopyUnit]) -> tuple[list[int], int, int]:
    """Pack a batch: ``(rows, block_ids_start, max_pages)``.

    ``rows`` is ``[group, first block-id index, staging offset] * units`` followed by every unit's
    block ids; ``block_ids_start`` is where the block ids begin; ``max_pages`` the largest unit's
    ``layers * blocks_per_chunk`` (the grid's x extent).
    """
    head: list[int] = []
    ids: list[int] = []
    max_pages = 0
    for unit in units:
        g = unit.group
        if len(unit.block_ids) != tables.blocks_per_chunk[g]:
            raise ValueError(f"group {g}: unit has {len(unit.block_ids)} block ids; allowed: "
                             f"exactly blocks_per_chunk={tables.blocks_per_chunk[g]}")
        head.extend((g, len(ids), unit.staging_offset))
        ids.extend(unit.block_ids)
        max_pages = max(max_pages, tables.num_layers[g] * tables.blocks_per_chunk[g])
    return head + ids, len(head), max_pages


def unit_nbytes(tables: KernelTables, unit: CopyUnit) -> int:
    return tables.chunk_bytes[unit.group]


def launch_shape(max_pages: int, num_units: int) -> tuple[tuple[int, int], tuple[int]]:
    """``(grid, block)``: one CUDA block per (page, unit), units strided past CUDA's y limit."""
    return (max(1, max_pages), max(1, min(num_units, MAX_GRID_Y))), (THREADS,)


def vector_ok(dst: int, src: int) -> bool:
    """Whether a page from ``src`` to ``dst`` takes the 16-byte path (as the kernel decides)."""
    return (dst ^ src) % VECTOR_BYTES == 0


def page_paths(tables: KernelTables, units: Sequence[CopyUnit], staging_address: int
               ) -> tuple[int, int]:
    """``(vector pages, byte-wise pages)`` of a gather of ``units`` (reports and tests)."""
    vec = byte = 0
    for unit in units:
        g = unit.group
        first, count, _ = tables.groups[GROUP_FIELDS * g: GROUP_FIELDS * (g + 1)]
        for layer in range(first, first + count):
            row = tables.layers[LAYER_FIELDS * layer: LAYER_FIELDS * (layer + 1)]
            base, stride, page, offset = row
            for j, b in enumerate(unit.block_ids):
                if b < 0:
                    continue
                dst = staging_address + unit.staging_offset + offset + j * page
                if vector_ok(dst, base + b * stride):
                    vec += 1
                else:
                    byte += 1
    return vec, byte


# -- loading -------------------------------------------------------------------------------------
_lock = threading.Lock()
_modules: dict[int, Any] = {}


def import_cupy() -> Any:
    """CuPy, or a KernelError saying how to get it."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported on the GPU path only
    except ImportError as exc:
        raise KernelError(
            f"the GPU path needs CuPy, which cannot be imported here ({exc}); install it with "
            "`pip install 'kvtierd[cuda]'` (cupy-cuda13x for CUDA 13 drivers, cupy-cuda12x for 12)"
        ) from None
    return cupy


def source() -> str:
    path = CUDA_DIR / SOURCE
    try:
        return path.read_text()
    except OSError as exc:
        raise KernelError(f"kernel source {path} cannot be read ({exc.strerror}); set "
                          "KVTIER_CUDA_DIR to the folder holding the cuda/*.cu files") from None


def load_module(device: int = 0) -> Any:
    """The compiled RawModule for ``device`` (compiled once per process and device)."""
    with _lock:
        module = _modules.get(device)
        if module is not None:
            return module
        cupy = import_cupy()
        try:
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=source(), options=("--std=c++14",),
                                        name_expressions=None)
                for name in KERNELS:  # compiles now, not at the first copy
                    module.get_function(name)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise KernelError(f"CUDA device {device} is not usable ({exc}); the GPU path needs "
                              "an NVIDIA driver and a visible GPU") from None
        except cupy.cuda.driver.CUDADriverError as exc:
            raise KernelError(f"the CUDA driver refused the kernels on device {device} ({exc}); "
                              "is the driver older than the CUDA of this CuPy build?") from None
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelError(f"NVRTC could not compile {SOURCE}:\n{exc}") from None
        except (OSError, RuntimeError) as exc:  # libnvrtc.so / libcuda.so not found, and kin
            raise KernelError(f"cannot load the CUDA libraries the kernels need ({exc}); install "
                              "the NVRTC of this CuPy build (e.g. nvidia-cuda-nvrtc) and a "
                              "driver") from None
        _modules[device] = module
        return module


class GatherScatter:
    """Launches the kernels for one client: static tables on ``device``, one upload per batch."""

    def __init__(self, tables: KernelTables, device: int) -> None:
        self.cupy = import_cupy()
        self.tables = tables
        self.device = device
        module = load_module(device)
        with self.cupy.cuda.Device(device):  # else a function handle binds to the current GPU
            self._kernels = {name: module.get_function(name) for name in KERNELS}
            self._layers = self.cupy.asarray(tables.layers or (0,), dtype=self.cupy.int64)
            self._groups = self.cupy.asarray(tables.groups, dtype=self.cupy.int64)
            self._host, self._dev = self._buffers(1024)
            self._uploaded = self.cupy.cuda.Event(disable_timing=True)
            self._uploaded.record()

    def _buffers(self, count: int) -> tuple[Any, Any]:
        """A pinned host array and a device array of ``count`` int64 (the per-batch rows)."""
        import cupyx  # noqa: PLC0415 - ships with CuPy

        return (cupyx.empty_pinned((count,), dtype=self.cupy.int64),
                self.cupy.empty(count, dtype=self.cupy.int64))

    def gather(self, units: Sequence[CopyUnit], staging_address: int, stream: Any) -> None:
        self._launch("kvtier_gather", units, staging_address, stream)

    def scatter(self, units: Sequence[CopyUnit], staging_address: int, stream: Any) -> None:
        self._launch("kvtier_scatter", units, staging_address, stream)

    def _launch(self, name: str, units: Sequence[CopyUnit], staging_address: int,
                stream: Any) -> None:
        if not units:
            return
        import numpy  # noqa: PLC0415 - torch's dependency; here to keep the module light

        rows, ids_start, max_pages = unit_rows(self.tables, units)
        cp = self.cupy
        with cp.cuda.Device(self.device):
            self._uploaded.synchronize()  # the last launch no longer reads its rows
            if self._host.size < len(rows):
                self._host, self._dev = self._buffers(2 * len(rows))
            host = self._host[:len(rows)]
            host[:] = rows
            self._dev[:len(rows)].set(host, stream=stream)
            grid, block = launch_shape(max_pages, len(units))
            units_ptr = self._dev.data.ptr
            self._kernels[name](grid, block, (
                self._layers, self._groups, numpy.uint64(units_ptr),
                numpy.uint64(units_ptr + 8 * ids_start), numpy.uint64(staging_address),
                numpy.int64(len(units))), stream=stream)
            self._uploaded.record(stream)  # after the launch: its rows are read until it ends
