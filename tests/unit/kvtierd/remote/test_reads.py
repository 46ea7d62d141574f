"""How a remote read job is laid out: where each object's header lands, and how the job is cut
into Mooncake calls so that verifying one call overlaps the next call's transfer."""

from __future__ import annotations

import random

from kvtierd.remote import objects
from kvtierd.remote.reads import Read, header_fits_after, read_calls
from kvtierd.tiers.chunk import ChunkEntry


def reads_of(sizes: list[int]) -> list[Read]:
    return [Read(f"obj-{i}", ChunkEntry(i, "fp", n, [(i, 1)], 0), [(0, n)], [(0, n)], True)
            for i, n in enumerate(sizes)]


def test_the_header_lands_after_the_payload_only_inside_the_targets_own_pages() -> None:
    page, h = 65536, objects.HEADER_BYTES
    assert header_fits_after([(3, 5)], [(3 * page, 4 * page)], page)  # a spare page
    assert not header_fits_after([(3, 4)], [(3 * page, 4 * page)], page)  # payload fills it
    assert header_fits_after([(3, 1)], [(3 * page, page - h)], page)  # room in the last page
    assert not header_fits_after([(3, 1)], [(3 * page, page - h + 1)], page)
    # the payload ends in the first run; a spare second run is elsewhere: not contiguous
    assert not header_fits_after([(3, 2), (9, 1)], [(3 * page, 2 * page)], page)
    assert header_fits_after([(3, 2), (9, 2)], [(3 * page, 2 * page), (9 * page, page)], page)
    assert not header_fits_after([], [], page)


def test_a_read_job_is_cut_by_bytes_so_its_checks_overlap_the_next_transfer() -> None:
    mib = 1 << 20
    # 256 MiB of 256 KiB objects was one call of 1024 objects: now 16 calls of 64
    calls = read_calls(reads_of([mib // 4] * 1024), 1024, 16 * mib)
    assert [len(part) for _, part in calls] == [64] * 16
    assert [start for start, _ in calls] == list(range(0, 1024, 64))
    # an object larger than the bound is a call of its own; small ones around it are not merged in
    calls = read_calls(reads_of([mib, 40 * mib, mib, mib]), 8, 16 * mib)
    assert [[r.name for r in part] for _, part in calls] == [["obj-0"], ["obj-1"],
                                                              ["obj-2", "obj-3"]]
    assert read_calls([], 8, mib) == []


def test_read_calls_keep_every_read_once_in_order_within_both_bounds() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.choice((1, 100, 4096, 1 << 20, 3 << 20)) for _ in range(rng.randrange(40))]
        reads, max_objects, max_bytes = reads_of(sizes), rng.randrange(1, 9), rng.choice(
            (1, 4096, 2 << 20, 8 << 20))
        calls = read_calls(reads, max_objects, max_bytes)
        assert [r for _, part in calls for r in part] == reads
        for start, part in calls:
            assert part and reads[start] is part[0] and len(part) <= max_objects
            assert len(part) == 1 or sum(r.entry.nbytes for r in part) <= max_bytes
        # a call ends only where the next object would break a bound
        for (_, part), (_, after) in zip(calls, calls[1:]):
            total = sum(r.entry.nbytes for r in part) + after[0].entry.nbytes
            assert len(part) == max_objects or total > max_bytes
