"""The NVMe tier's I/O path: IoQueue (transfers in flight at once), chunks cut into pieces, and the
data file's group-committed fdatasync — on a real data file and a real shared-memory Arena."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import threading
import time
import uuid
from functools import partial

import pytest
import xxhash

from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import segments
from kvtierd.tiers.nvme import IO_PIECE_BYTES, NvmeTier, _transfers
from kvtierd.tiers.nvme_file import DataFile, IoQueue

PAGE = 4096
IOV_MAX = 1024  # Linux: a preadv/pwritev with more views is refused (EINVAL)
POISON = 0xAB


@pytest.fixture
def queue():
    q = IoQueue(4)
    yield q
    q.close()


def test_io_queue_runs_depth_transfers_at_once_and_never_more(queue):
    lock = threading.Lock()
    running = [0, 0]  # now, most at once
    barrier = threading.Barrier(queue.depth, timeout=30)  # breaks unless `depth` run together

    def transfer() -> None:
        with lock:
            running[0] += 1
            running[1] = max(running)
        barrier.wait()
        with lock:
            running[0] -= 1

    queue.run([transfer] * (3 * queue.depth))
    assert running == [0, queue.depth]


def test_io_queue_waits_for_every_transfer_then_raises_the_first_error(queue):
    finished = []

    def slow() -> None:
        time.sleep(0.2)  # still running when the errors below are raised
        finished.append("slow")

    def fail(n: int) -> None:
        raise OSError(errno.EIO, f"transfer {n}")

    with pytest.raises(OSError, match="transfer 1"):
        queue.run([slow, partial(fail, 1), partial(fail, 2)])
    assert finished == ["slow"], "run() returned while a transfer still used the job's buffers"
    queue.run([slow])  # the queue keeps working after an error
    assert finished == ["slow", "slow"]


def test_io_queue_error_keeps_no_buffer_alive_so_the_arena_can_close(queue):
    """Regression: the error's traceback and run()'s frame formed a cycle that kept the failed
    transfers' memoryviews alive until a GC pass, so the daemon could not close its arena at
    shutdown ("cannot close exported pointers exist") after an injected ENOSPC."""
    buf = mmap.mmap(-1, PAGE)

    def fail(view: memoryview) -> None:
        raise OSError(errno.ENOSPC, "injected")

    gc.disable()
    try:
        try:
            queue.run([partial(fail, memoryview(buf)), partial(fail, memoryview(buf)[:8])])
        except OSError:
            pass
        buf.close()  # BufferError if a view survived
    finally:
        gc.enable()


def test_io_queue_refuses_a_depth_below_one():
    with pytest.raises(ValueError, match="depth must be >= 1, not 0"):
        IoQueue(0)


def test_pieces_pair_pages_in_order_and_stay_below_the_piece_size_and_iov_max():
    arena = bytearray(8192 * PAGE)

    class Buffer:  # _transfers reads only .view: the arena's bytes
        view = memoryview(arena)

    file_runs = [(10, 700), (2000, 3), (5000, 1300)]  # 2003 pages
    arena_runs = [(p, 1) for p in range(0, 4006, 2)]  # every other page: nothing merges
    pieces = list(_transfers(file_runs, arena_runs, Buffer, PAGE, IO_PIECE_BYTES // PAGE))
    file_pages, arena_offsets = [], []
    for first, views in pieces:
        assert sum(len(v) for v in views) <= IO_PIECE_BYTES
        assert len(views) <= IOV_MAX
        file_pages += range(first, first + sum(len(v) for v in views) // PAGE)
        arena_offsets += [v.obj is arena and _offset(arena, v) for v in views]
    assert file_pages == [p for s, c in file_runs for p in range(s, s + c)]
    assert arena_offsets == [p * PAGE for p, _ in arena_runs]
    assert len(pieces) == 2 + 1 + 3  # 700 = 512 + 188; 3; 1300 = 512 + 512 + 276


def _offset(base: bytearray, view: memoryview) -> int:
    import ctypes

    start = ctypes.addressof(ctypes.c_char.from_buffer(base))
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) - start


def test_big_chunk_from_a_fragmented_arena_round_trips_byte_for_byte(tmp_path, request):
    """Regression: a chunk whose arena pages do not merge was one pwritev per file run, with
    one view per page: 2048 views for an 8 MiB chunk of 4 KiB pages, above IOV_MAX (EINVAL).
    Now it goes in pieces of <= 2 MiB, all in flight at once, and reads back exactly."""
    pages = 2048
    arena = Arena(name=f"kvtierd-test-nvmeio-{uuid.uuid4().hex}", nbytes=2 * pages * PAGE,
                  prefault=False, lock=False)
    request.addfinalizer(lambda: arena.close(unlink=True))
    tier = NvmeTier(tmp_path / "nvme", (pages + 16) * PAGE, PAGE, queue_depth=4)
    request.addfinalizer(tier.close)
    src = [(p, 1) for p in range(0, 2 * pages, 2)]
    dst = [(p, 1) for p in range(1, 2 * pages, 2)]
    data = os.urandom(pages * PAGE)
    pos = 0
    for offset, length in segments(src, len(data), PAGE):
        arena.view[offset:offset + length] = data[pos:pos + length]
        pos += length
    entry = tier.reserve((("uid:1", "ns", 0), b"big"), "fp", len(data),
                         xxhash.xxh3_128_digest(data))
    assert entry is not None
    assert tier.write_job([(entry, src)], arena)() == len(data)
    tier.commit(entry)
    for start, count in dst:
        arena.view[start * PAGE:(start + count) * PAGE] = bytes([POISON]) * (count * PAGE)
    dst_segments = segments(dst, len(data), PAGE)
    assert tier.read_job(entry, arena, dst, dst_segments)() == len(data)
    back = b"".join(bytes(arena.view[o:o + n]) for o, n in dst_segments)
    assert back == data
    tier.check_invariants()


@pytest.fixture
def data_file(tmp_path):
    f = DataFile(tmp_path, 64 * PAGE, PAGE, direct=False)
    yield f
    f.close()


def test_concurrent_syncs_all_return_and_every_write_reads_back(data_file):
    blocks = {page: os.urandom(PAGE) for page in range(16)}
    errors = []

    def writer(page: int) -> None:
        try:
            data_file.write(page, [memoryview(bytearray(blocks[page]))])
            data_file.sync()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in blocks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    for page, block in blocks.items():
        back = bytearray(PAGE)
        data_file.read(page, [memoryview(back)])
        assert bytes(back) == block


def test_a_failed_fdatasync_covers_nobody(data_file, tmp_path):
    good = data_file.fd
    bad = os.open(tmp_path / "closed", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(bad)  # a descriptor number that fdatasync refuses (EBADF)
    data_file.fd = bad
    try:
        with pytest.raises(OSError):
            data_file.sync()
        with pytest.raises(OSError):  # not skipped as "covered" by the failed one
            data_file.sync()
    finally:
        data_file.fd = good
    data_file.sync()
