"""NvmeTier unit-test support: a real directory (data file + SQLite index), a real shared-memory
arena, and helpers that write, read and inspect chunks (tests/unit/kvtierd/tiers/test_nvme*.py)."""

from __future__ import annotations

import os
import sqlite3
import uuid

import pytest
import xxhash

from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import segments
from kvtierd.tiers.index_db import unpack_runs
from kvtierd.tiers.nvme import INDEX_NAME, NvmeTier
from kvtierd.tiers.nvme_file import DATA_NAME

PAGE = 4096
NVME_PAGES = 32
ARENA_PAGES = 64
SPACE = ("uid:1000", "ns", 0)  # (tenant, namespace, rank)
POISON = 0xAB


@pytest.fixture
def arena(request):
    arena = Arena(name=f"kvtierd-test-nvme-{uuid.uuid4().hex}", nbytes=ARENA_PAGES * PAGE,
                  prefault=False, lock=False)
    request.addfinalizer(lambda: arena.close(unlink=True))
    return arena


@pytest.fixture
def arena_pages():
    return PageAllocator(ARENA_PAGES)


@pytest.fixture
def nvme_dir(tmp_path):
    return tmp_path / "nvme"


class Tiers:
    """Opens tiers on one directory and closes whatever is still open at the end."""

    def __init__(self, directory):
        self.directory = directory
        self.open: list[NvmeTier] = []

    def __call__(self, pages: int = NVME_PAGES, **kwargs) -> NvmeTier:
        tier = NvmeTier(self.directory, pages * PAGE, PAGE, **kwargs)
        self.open.append(tier)
        return tier

    def close(self, tier: NvmeTier) -> None:
        tier.check_invariants()
        tier.close()
        self.open.remove(tier)


@pytest.fixture
def tiers(nvme_dir):
    t = Tiers(nvme_dir)
    yield t
    for tier in list(t.open):
        t.close(tier)


def ikey(key: bytes):
    return (SPACE, key)


def fill(arena: Arena, runs, data: bytes) -> None:
    pos = 0
    for offset, length in segments(runs, len(data), PAGE):
        arena.view[offset:offset + length] = data[pos:pos + length]
        pos += length


def read_arena(arena: Arena, runs, nbytes: int) -> bytes:
    return b"".join(bytes(arena.view[o:o + n]) for o, n in segments(runs, nbytes, PAGE))


def poison(arena: Arena, runs) -> None:
    for start, count in runs:
        arena.view[start * PAGE:(start + count) * PAGE] = bytes([POISON]) * (count * PAGE)


def put(tier: NvmeTier, arena: Arena, arena_pages: PageAllocator, key: bytes, nbytes: int):
    """Reserve, write (data, fdatasync, row) and commit one chunk; returns (entry, payload)."""
    data = os.urandom(nbytes)
    src = arena_pages.allocate(tier.pages_for(nbytes))
    fill(arena, src, data)
    entry = tier.reserve(ikey(key), "fp", nbytes, xxhash.xxh3_128_digest(data))
    assert entry is not None
    assert tier.write_job([(entry, src)], arena)() == entry.pages * PAGE
    tier.commit(entry)
    arena_pages.free(src)
    tier.check_invariants()
    return entry, data


def read(tier: NvmeTier, arena: Arena, arena_pages: PageAllocator, entry) -> bytes:
    dst = arena_pages.allocate(entry.pages)
    try:
        poison(arena, dst)
        assert tier.read_job(entry, arena, dst, segments(dst, entry.nbytes, PAGE))() == \
            entry.nbytes
        return read_arena(arena, dst, entry.nbytes)
    finally:
        arena_pages.free(dst)


def disk_rows(directory) -> dict:
    db = sqlite3.connect(f"file:{directory / INDEX_NAME}?mode=ro", uri=True)
    try:
        return {bytes(k): unpack_runs(r) for k, r in db.execute("SELECT key, runs FROM chunks")}
    finally:
        db.close()


def flip(directory, page: int, offset: int = 0) -> None:
    fd = os.open(directory / DATA_NAME, os.O_RDWR)
    try:
        pos = page * PAGE + offset
        os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0x01]), pos)
        os.fsync(fd)
    finally:
        os.close(fd)

