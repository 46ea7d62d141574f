"""Gather/scatter for CPU tensors at memcpy speed: one compiled pass of merged byte runs per group.

The torch reference (``copies``) does one ``index_select``/``index_copy_`` per layer per unit: a
generic gather kernel that runs at 0.5–2 GB/s for page-sized rows. Here each group of a batch is
one call compiled by Numba (``nogil``): it walks every unit's layers and blocks, works out each
page's ``(kv address, staging address, nbytes)``, merges runs that continue each other in *both*
buffers (consecutive blocks of a contiguous cache, consecutive layers of one allocation) and
copies each merged run (into staging with the daemon's streaming-store copy, ``_streaming_copy``;
out of it with libc ``memmove``), so a batch costs one Python call per group whatever its page
count. A Python loop of ``ctypes.memmove`` spent ~1.3 us of interpreter time per
run, which halved the speed of 8 KiB pages (3.5 against 7.6 GB/s measured here); the compiled loop
also runs without the GIL, so the engine's threads and the heartbeat run while it copies.

Same semantics as the reference, byte for byte (tests compare the two): payload order
``[layer][block][page]`` with each layer's own page size, block id -1 skipped (its staging bytes
untouched). Safety rests on what is validated before anything is copied: every layer's pages lie
inside its storage (``copies.page_view``), every block id is -1 or inside the cache (the client's
``_checked``), and every unit's range lies inside the staging buffer (checked here per batch, for
every group before the first copy).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .copies import CopyUnit, LayerPages



@functools.cache
def _copy_runs() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """``copy(dst, src, nbytes)``: memmove each run; compiled on first use (~1 s, once a process),
    so importing the client stays cheap. Not cached on disk: the code embeds libc's address."""
    import numba

    memmove = _libc_memmove()

    @numba.njit("void(int64[::1], int64[::1], int64[::1])", nogil=True)
    def copy(dst, src, nbytes):  # pragma: no cover - compiled
        for i in range(dst.shape[0]):
            memmove(dst[i], src[i], nbytes[i])

    return copy


def _libc_memmove() -> Callable[[int, int, int], int]:
    """libc's ``memmove`` with addresses as 64-bit integers, callable from compiled code (passed
    exactly as pointers are: x86-64 and AArch64 ABIs)."""
    memmove = ctypes.CDLL(None).memmove
    memmove.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    memmove.restype = ctypes.c_int64
    return memmove


def _streaming_copy() -> Callable[[int, int, int], object]:
    """``copy(dst, src, nbytes)`` for the gather into staging: the daemon's copy with streaming
    stores (``kvtierd.copy._ranges``), which writes staging without first reading its lines into
    the cache as a plain memmove does. Staging is read next by the daemon's copy, not by this
    process, so nothing is lost by keeping it out of this core's cache. Measured with
    ``benchmarks/client_path.py``, 8 runs alternating with the memmove gather (the daemon's PUT
    streaming in both): store / ceiling medians 0.93 / 1.12 / 0.96x at 256 KiB / 2 MiB / 8 MiB
    chunks against 0.89 / 1.04 / 0.94x. libc's memmove where the extension was not built."""
    try:
        from kvtierd.copy import _ranges
    except ImportError:  # built without a C compiler: the install's extensions are optional
        return _libc_memmove()
    return ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(
        _ranges.streaming_copy_address())


@functools.cache
def _copy_units() -> Callable[..., int]:
    """``copy(ids, unit_addr, base, stride, page, before, into_staging) -> memmoves``: one group's
    units planned and copied in one compiled pass, each run merged with the next as it goes, so
    a batch costs no numpy passes over its runs (planned in numpy they took ~0.2 ms of a 32 MiB
    call, 2-3 % of a store, measured on 3 December). Compiled on first use, as ``_copy_runs``."""
    import numba

    memmove = _libc_memmove()
    stream = _streaming_copy()

    @numba.njit(nogil=True)
    def move(kv, st, nbytes, into_staging):  # pragma: no cover - compiled
        if into_staging:
            stream(st, kv, nbytes)
        else:
            memmove(kv, st, nbytes)

    @numba.njit("int64(int64[:, ::1], int64[::1], int64[::1], int64[::1], int64[::1], "
                "int64[::1], boolean)", nogil=True)
    def copy(ids, unit_addr, base, stride, page, before, into_staging):  # pragma: no cover
        units, blocks = ids.shape
        kv_run = st_run = length = 0
        moves = 0
        for u in range(units):
            for layer in range(base.shape[0]):
                n = page[layer]
                st = unit_addr[u] + blocks * before[layer]  # the layer's first page in the unit
                for position in range(blocks):
                    block = ids[u, position]
                    if block != -1:
                        kv = base[layer] + block * stride[layer]
                        if length and kv == kv_run + length and st == st_run + length:
                            length += n  # continues the run in both buffers
                        else:
                            if length:
                                move(kv_run, st_run, length, into_staging)
                                moves += 1
                            kv_run, st_run, length = kv, st, n
                    st += n
        if length:
            move(kv_run, st_run, length, into_staging)
            moves += 1
        return moves

    return copy


def warm_up() -> None:
    """Compile the copy loops now (the client does at construction, not in its first store)."""
    _copy_runs()
    _copy_units()


def copy_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    """``memmove(dst[i], src[i], nbytes[i])`` for every i, in one call without the GIL.
    Raw addresses: the caller vouches that every range is valid."""
    _copy_runs()(dst, src, nbytes)


class GroupGeometry:
    """One group's layers as arrays: base address of block 0, block stride, page bytes, and each
    layer's byte offset inside a unit of one block (multiply by the unit's block count)."""

    def __init__(self, layers: Sequence[LayerPages]) -> None:
        self.base = np.array([lp.pages.data_ptr() for lp in layers], dtype=np.int64)
        self.stride = np.array([lp.pages.stride(0) for lp in layers], dtype=np.int64)
        self.page = np.array([lp.pages.shape[1] for lp in layers], dtype=np.int64)
        self.before = np.concatenate(([0], np.cumsum(self.page)[:-1])).astype(np.int64)
        self.unit_block_bytes = int(self.page.sum())


def geometries(tables: list[list[LayerPages]]) -> list[GroupGeometry]:
    return [GroupGeometry(layers) for layers in tables]


def _group_arrays(geo: list[GroupGeometry], units: Sequence[CopyUnit], staging: torch.Tensor
                  ) -> list[tuple[GroupGeometry, np.ndarray, np.ndarray]]:
    """Per group of ``units``: its geometry, block ids ``[U, B]`` and units' staging addresses,
    every unit checked to lie inside ``staging`` (all groups before anything is copied)."""
    base = staging.data_ptr()
    out = []
    for g in sorted({u.group for u in units}):
        group_units = [u for u in units if u.group == g]
        ids = np.array([u.block_ids for u in group_units], dtype=np.int64)  # [U, B]
        offsets = np.array([u.staging_offset for u in group_units], dtype=np.int64)  # [U]
        _check_staging(offsets, ids.shape[1] * geo[g].unit_block_bytes, staging.numel())
        out.append((geo[g], ids, offsets + base))
    return out


def _copy(geo: list[GroupGeometry], units: Sequence[CopyUnit], staging: torch.Tensor,
          into_staging: bool) -> int:
    """Payload order ``[layer][block][page]`` per unit, each layer with its own page size, block
    id -1 skipped; runs that continue each other in both buffers copied as one (consecutive
    blocks of a contiguous cache, consecutive layers of one allocation). Returns the memmoves."""
    copy = _copy_units()
    return sum(copy(ids, addr, g.base, g.stride, g.page, g.before, into_staging)
               for g, ids, addr in _group_arrays(geo, units, staging))


def _check_staging(offsets: np.ndarray, unit_bytes: int, staging_bytes: int) -> None:
    if offsets.size and (offsets.min() < 0 or offsets.max() + unit_bytes > staging_bytes):
        raise ValueError(f"a unit of {unit_bytes} bytes at staging offsets "
                         f"{offsets.min()}..{offsets.max()} leaves the staging buffer of "
                         f"{staging_bytes} bytes; allowed: units inside the buffer")


def gather(geo: list[GroupGeometry], units: Sequence[CopyUnit], staging: torch.Tensor) -> int:
    """Copy every unit's pages from the KV cache into its staging range; returns the memmoves."""
    return _copy(geo, units, staging, True)


def scatter(geo: list[GroupGeometry], units: Sequence[CopyUnit], staging: torch.Tensor) -> int:
    """Copy every unit's staging range back into its blocks of the KV cache; returns the
    memmoves."""
    return _copy(geo, units, staging, False)
