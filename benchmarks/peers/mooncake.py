"""Mooncake Store as a peer: its own Python client's zero-copy batched puts and gets of raw bytes.

``run(sizes, rounds, workdir)`` is the peer interface of ``benchmarks/vs_peers.py``: it starts a
real Mooncake Store in a private network namespace (``mooncake_master`` with its HTTP metadata
server, and a ``mooncake_client`` store process lending the memory, so that bytes cross a process
boundary over TCP as to another node; ``tests/helpers/mooncake.py``), then for each chunk size
stores and loads the same bytes with ``batch_put_from`` / ``batch_get_into`` from and into a
buffer registered with Mooncake's transfer engine (the fastest path its Python client offers),
and checks the loaded bytes. The best of ``rounds`` counts.

``measure(client, region, ...)`` is the same measurement on a client that is already connected
(``benchmarks/remote_tier.py`` interleaves it with kvtierd's remote tier on one store).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import xxhash

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from helpers import mooncake as mc  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from cores_busy import CoresBusy  # noqa: E402

#: Objects per batch call; kvtierd's remote tier splits its jobs the same way.
BATCH = 64
#: Bytes moved per chunk size and round (the store process lends twice this).
BYTES_PER_SIZE = 256 * 1024**2
#: A header slot of ``measure(trailer=...)`` (kvtierd's trailer is 84 bytes).
_SLOT_BYTES = 256


class Region:
    """Page-aligned anonymous memory with its address (registered with a client by the caller)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mmap = mmap.mmap(-1, nbytes)
        self._anchor = ctypes.c_char.from_buffer(self.mmap)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mmap)

    def close(self) -> None:
        self.view.release()
        del self._anchor
        self.mmap.close()


@contextmanager
def store(workdir: Path, segment_bytes: int) -> Iterator[mc.MooncakeMaster]:
    """A namespaced master and a store process lending ``segment_bytes``; this process may then
    make clients in ``master.ns`` (one namespace per process: see ``mc.shared_master``)."""
    master = mc.shared_master(workdir)
    server = mc.SegmentServer(master, segment_bytes)
    try:
        server.wait_mounted()
        yield master
    finally:
        server.stop()


def measure(client, region: Region, chunk_bytes: int, nbytes: int, ns, threads: int = 0,
            verify: bool = False, trailer: int = 0) -> dict:
    """One round: put ``nbytes`` as chunks of ``chunk_bytes`` from the first half of ``region``,
    get them into the second half; GB/s of payload each way (bytes verified after the clock
    stops). With ``threads``, the gets are one key per call on that many threads (the access
    pattern of kvtierd's promotions, one read job per chunk) instead of batches. With ``verify``,
    each batch's payloads are hashed (xxh3-128, as kvtierd verifies every object it fetches)
    before the next batch is asked for, inside the clock: the ceiling of a client that checks its
    bytes. ``load_cores_busy``: the cores the machine kept busy (every process) while the gets ran.

    With ``trailer`` (bytes), each object is stored as kvtierd stores one: its payload and then a
    trailer kept elsewhere (a header slot at the region's end), put as two buffers of one
    ``batch_put_from_multi_buffers`` entry, and read back whole into one buffer per object: the
    same calls and the same transfers as kvtierd's remote tier, by Mooncake's own client."""
    count = max(1, nbytes // chunk_bytes)
    stride = chunk_bytes + trailer
    slots = region.nbytes - BATCH * _SLOT_BYTES if trailer else region.nbytes
    half = region.nbytes // 2
    assert count * chunk_bytes <= half and half + count * stride <= slots, "region too small"
    assert trailer <= _SLOT_BYTES, f"a trailer of {trailer} bytes exceeds a header slot"
    region.view[:count * chunk_bytes] = os.urandom(count * chunk_bytes)
    if trailer:
        region.view[slots:] = os.urandom(region.nbytes - slots)
    keys = [f"peer-mooncake/{uuid.uuid4().hex}/{i}" for i in range(count)]
    src = [region.address + i * chunk_bytes for i in range(count)]
    dst = [region.address + half + i * stride for i in range(count)]
    sizes = [stride] * count
    region.view[half:half + count * stride] = b"\xa5" * (count * stride)  # poison
    with ns.entered():
        start = time.perf_counter()
        for i in range(0, count, BATCH):
            if trailer:
                codes = client.batch_put_from_multi_buffers(
                    keys[i:i + BATCH],
                    [[a, region.address + slots + j * _SLOT_BYTES]
                     for j, a in enumerate(src[i:i + BATCH])],
                    [[chunk_bytes, trailer]] * len(src[i:i + BATCH]))
            else:
                codes = client.batch_put_from(keys[i:i + BATCH], src[i:i + BATCH],
                                              sizes[i:i + BATCH])
            assert all(c == 0 for c in codes), codes
        put_s = time.perf_counter() - start
        load = CoresBusy()  # every process's cores: the store process's side too
        start = time.perf_counter()
        if threads:
            def one(i: int) -> None:
                with ns.entered():
                    assert client.get_into(keys[i], dst[i], stride) == stride

            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(count)))
        else:
            for i in range(0, count, BATCH):
                codes = client.batch_get_into(keys[i:i + BATCH], dst[i:i + BATCH],
                                              sizes[i:i + BATCH])
                assert all(c == stride for c in codes), codes
                if verify:
                    for j in range(i, min(i + BATCH, count)):
                        offset = half + j * stride
                        xxhash.xxh3_128_digest(region.view[offset:offset + chunk_bytes])
        get_s = time.perf_counter() - start
        load_cores = load.stop()
        client.batch_remove(keys, True)
    total = count * chunk_bytes
    got = region.view[half:half + count * stride]
    if trailer:
        for i in range(count):
            assert got[i * stride:i * stride + chunk_bytes] == region.view[
                i * chunk_bytes:(i + 1) * chunk_bytes], f"Mooncake returned other bytes ({i})"
            assert got[i * stride + chunk_bytes:(i + 1) * stride] == region.view[
                slots + (i % BATCH) * _SLOT_BYTES:][:trailer], f"other trailer bytes ({i})"
    else:
        assert got == region.view[:total], "Mooncake returned other bytes"
    return {"chunk_bytes": chunk_bytes, "chunks": count, "bytes": total,
            "store_gbps": total / put_s / 1e9, "load_gbps": total / get_s / 1e9,
            "load_cores_busy": load_cores}


def region_bytes(nbytes: int, trailer: int = 0) -> int:
    """The ``Region`` size ``measure`` needs for ``nbytes`` a round (room for the trailers and
    the header slots when ``trailer``)."""
    if not trailer:
        return 2 * nbytes
    return 2 * nbytes + nbytes // 2 + BATCH * _SLOT_BYTES


def connect(master: mc.MooncakeMaster, region: Region):
    client = mc.raw_client(master, segment_bytes=0)
    with master.ns.entered():
        assert client.register_buffer(region.address, region.nbytes) == 0
    return client


def run(sizes: list[int], rounds: int, workdir: Path) -> list[dict]:
    """The peer rows of ``benchmarks/vs_peers.py`` (best of ``rounds`` per size)."""
    if mc.unavailable_reason():
        raise RuntimeError(f"Mooncake peer unavailable: {mc.unavailable_reason()}")
    nbytes = min(BYTES_PER_SIZE, max(sizes) * 64)
    region = Region(2 * max(nbytes, max(sizes)))
    rows = []
    with store(workdir / "mooncake", 2 * region.nbytes) as master:
        client = connect(master, region)
        try:
            for size in sizes:
                best = [measure(client, region, size, nbytes, master.ns) for _ in range(rounds)]
                rows.append({"peer": "mooncake", "path": "raw bytes", "chunk_bytes": size,
                             "store_gbps": max(r["store_gbps"] for r in best),
                             "load_gbps": max(r["load_gbps"] for r in best)})
        finally:
            with master.ns.entered():
                client.unregister_buffer(region.address)
                client.close()
            region.close()
    return rows
