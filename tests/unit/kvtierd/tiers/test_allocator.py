"""PageAllocator against a model (a set of free pages): no page handed out twice, runs coalesce."""

import random

import pytest

from kvtierd.tiers.allocator import PageAllocator, trim_runs


def pages_of(runs) -> set[int]:
    out: set[int] = set()
    for start, count in runs:
        assert count > 0
        out.update(range(start, start + count))
    return out


def check(alloc: PageAllocator, model_free: set[int]) -> None:
    alloc.check_invariants()
    assert pages_of(alloc.free_runs()) == model_free
    assert alloc.free_pages == len(model_free)


@pytest.mark.parametrize("seed", range(8))
def test_random_allocate_free_matches_model(seed):
    rng = random.Random(seed)
    num_pages = rng.choice([1, 7, 64, 300])
    alloc = PageAllocator(num_pages)
    model_free = set(range(num_pages))
    live: list[list[tuple[int, int]]] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            runs = live.pop(rng.randrange(len(live)))
            alloc.free(runs)
            model_free |= pages_of(runs)
        else:
            count = rng.randint(1, max(1, num_pages // 4))
            runs = alloc.allocate(count)
            if count > len(model_free):
                assert runs is None
            else:
                got = pages_of(runs)
                assert sum(c for _, c in runs) == count == len(got)  # no page twice in one answer
                assert got <= model_free  # never a page someone else holds
                model_free -= got
                live.append(runs)
        check(alloc, model_free)
    for runs in live:
        alloc.free(runs)
    assert alloc.free_runs() == [(0, num_pages)]  # everything coalesced into one extent
    check(alloc, set(range(num_pages)))


def test_allocate_returns_none_when_short():
    alloc = PageAllocator(10)
    held = alloc.allocate(7)
    assert alloc.allocate(4) is None
    assert alloc.free_pages == 3  # a refused allocation takes nothing
    assert alloc.allocate(3) is not None and alloc.allocate(1) is None
    alloc.free(held)
    check(alloc, set(range(7)))


def test_fragmented_allocation_spans_runs():
    alloc = PageAllocator(64)
    blocks = [alloc.allocate(4) for _ in range(16)]
    assert pages_of(r for b in blocks for r in b) == set(range(64))
    for block in blocks[::2]:  # free every other run: 8 holes of 4 pages
        alloc.free(block)
    assert len(alloc.free_runs()) == 8 and alloc.allocate(5) is not None
    runs = alloc.allocate(10)
    assert len(runs) >= 3 and sum(c for _, c in runs) == 10
    holes = pages_of(r for b in blocks[::2] for r in b)
    assert pages_of(runs) <= holes
    alloc.check_invariants()
    assert alloc.free_pages == 32 - 5 - 10


def test_first_fit_uses_one_run_when_possible():
    alloc = PageAllocator(32)
    a, b, c = alloc.allocate(4), alloc.allocate(8), alloc.allocate(4)
    alloc.free(a)
    alloc.free(b)  # coalesces with a: pages 0..12 free
    assert alloc.free_runs() == [(0, 12), (16, 16)]
    assert alloc.allocate(12) == [(0, 12)]
    alloc.free(c)
    alloc.check_invariants()


def test_allocate_run_is_one_run_or_nothing():
    alloc = PageAllocator(16)
    blocks = [alloc.allocate(4) for _ in range(4)]
    alloc.free(blocks[0])
    alloc.free(blocks[2])  # two holes of 4 pages
    assert alloc.allocate_run(5) is None and alloc.free_pages == 8  # took nothing
    assert alloc.allocate_run(3) == (0, 3)
    assert alloc.allocate_run(4) == (8, 4)
    alloc.check_invariants()
    assert alloc.free_runs() == [(3, 1)]


def test_trim_runs_keeps_the_first_pages():
    assert trim_runs([(10, 5)], 4) == ([(10, 4)], [(14, 1)])
    assert trim_runs([(10, 2), (20, 3)], 4) == ([(10, 2), (20, 2)], [(22, 1)])
    assert trim_runs([(10, 2), (20, 3)], 2) == ([(10, 2)], [(20, 3)])
    assert trim_runs([(10, 2), (20, 3)], 5) == ([(10, 2), (20, 3)], [])


def test_double_free_and_out_of_range_raise():
    alloc = PageAllocator(16)
    runs = alloc.allocate(6)
    alloc.free(runs)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(runs)
    part = alloc.allocate(16)
    alloc.free([(2, 3)])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([(4, 2)])  # overlaps the tail of a free extent
    with pytest.raises(ValueError, match="double free"):
        alloc.free([(0, 3)])  # overlaps the head of a free extent
    for bad in [(-1, 1), (15, 2), (3, 0)]:
        with pytest.raises(ValueError, match="outside"):
            alloc.free([bad])
    alloc.check_invariants()
    assert alloc.free_runs() == [(2, 3)] and part == [(0, 16)]


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_counts_raise(bad):
    with pytest.raises(ValueError):
        PageAllocator(bad)
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(bad)


@pytest.mark.parametrize("seed", range(10))
def test_free_many_leaves_what_free_of_each_run_leaves(seed):
    """free_many (a DELETE batch: runs sorted, touching runs merged before the extents are
    searched) against free of each run in any order: the same extents, on a fragmented
    allocator, for runs side by side and scattered."""
    rng = random.Random(seed)
    many, each = PageAllocator(300), PageAllocator(300)
    held = []
    while True:
        count = rng.choice([1, 1, 2, 5])
        runs = each.allocate(count)
        if runs is None:
            break
        assert many.allocate(count) == runs
        held.extend(runs)
    for _ in range(4):
        batch = rng.sample(held, rng.randint(1, len(held) // 4))
        if rng.random() < 0.5:  # side by side, as a PUT batch placed them
            first = rng.randrange(len(held) - len(batch))
            batch = held[first:first + len(batch)]
        held = [run for run in held if run not in batch]
        for run in rng.sample(batch, len(batch)):
            each.free([run])
        many.free_many(list(batch))
        many.check_invariants()
        assert many.free_runs() == each.free_runs() and many.free_pages == each.free_pages


def test_free_many_refuses_double_and_bad_runs():
    alloc = PageAllocator(16)
    alloc.allocate(16)
    alloc.free([(4, 2)])
    for bad, match in [([(0, 2), (1, 2)], "double free"), ([(8, 1), (8, 1)], "double free"),
                       ([(3, 2)], "double free"), ([(9, 1), (10, 0)], "outside"),
                       ([(14, 3)], "outside")]:
        with pytest.raises(ValueError, match=match):
            alloc.free_many(bad)
        alloc.check_invariants()
    assert alloc.free_runs() == [(4, 2)]


@pytest.mark.parametrize("seed", range(6))
def test_allocate_starts_hands_out_the_first_pages_of_allocate_many(seed):
    rng = random.Random(seed)
    a, b = PageAllocator(400), PageAllocator(400)
    held = []
    for _ in range(40):  # fragment both the same way
        runs = a.allocate(rng.randint(1, 9))
        assert runs == b.allocate(sum(c for _, c in runs))
        held.append(runs)
    for runs in rng.sample(held, 20):
        a.free(runs)
        b.free(runs)
    count, n = rng.randint(1, 6), rng.randint(1, 60)
    assert b.allocate_starts(count, n) == [start for start, _ in a.allocate_many(count, n)]
    assert a.free_runs() == b.free_runs() and a.free_pages == b.free_pages
    with pytest.raises(ValueError, match="positive"):
        a.allocate_starts(0, 1)


@pytest.mark.parametrize("seed", range(8))
def test_free_starts_frees_what_free_many_frees(seed):
    """A DELETE's runs as first pages and one page count (side by side, as a PUT placed them,
    or scattered) or as a list of counts: the same extents as ``free_many`` of the runs."""
    rng = random.Random(seed)
    count = rng.choice([1, 2, 4])
    many, starts = PageAllocator(512), PageAllocator(512)
    held = many.allocate_starts(count, 512 // count)
    assert starts.allocate_starts(count, 512 // count) == held
    for _ in range(5):
        if not held:
            break
        batch = rng.sample(held, rng.randint(1, max(1, len(held) // 3)))
        if rng.random() < 0.5:  # side by side
            first = rng.randrange(len(held) - len(batch) + 1)
            batch = held[first:first + len(batch)]
        held = [s for s in held if s not in batch]
        many.free_many([(s, count) for s in rng.sample(batch, len(batch))])
        shuffled = rng.sample(batch, len(batch))
        starts.free_starts(shuffled, count if rng.random() < 0.7 else [count] * len(batch))
        starts.check_invariants()
        assert starts.free_runs() == many.free_runs() and starts.free_pages == many.free_pages


def test_free_starts_refuses_overlapping_and_bad_runs_before_freeing_any():
    alloc = PageAllocator(16)
    alloc.allocate(16)
    alloc.free([(4, 2)])
    for starts, count, match in [([0, 1], 2, "double free"), ([8, 8], 1, "double free"),
                                 ([3], 2, "double free"), ([9, 10], 0, "outside"),
                                 ([14], 3, "outside"), ([0, 2, 3], 2, "double free"),
                                 ([0, 8, 9], 2, "double free")]:
        with pytest.raises(ValueError, match=match):
            alloc.free_starts(starts, count)
        alloc.check_invariants()
        assert alloc.free_runs() == [(4, 2)], (starts, count)
    alloc.free_starts([], 3)
    alloc.free_starts([8, 10, 6], 2)  # touching runs, out of order: one extent with (4, 2)
    assert alloc.free_runs() == [(4, 8)]


def test_allocate_extents_are_the_stretches_of_allocate_many():
    a, b = PageAllocator(64), PageAllocator(64)
    for alloc in (a, b):  # free holes of 5, 7 and 14 pages
        alloc.allocate(64)
        alloc.free([(0, 5), (10, 7), (40, 14)])
    extents = b.allocate_extents(3, 8)
    assert extents == [(0, 1), (10, 2), (40, 4)]
    assert [(first + k * 3, 3) for first, runs in extents for k in range(runs)] == \
        a.allocate_many(3, 8)
    assert a.free_runs() == b.free_runs() == [(3, 2), (16, 1), (52, 2)]


@pytest.mark.parametrize("free", ["free", "free_many"])
def test_a_batch_with_one_bad_run_frees_none_of_its_runs(free):
    """A double free or an out-of-range run anywhere in a batch is refused before any of the
    batch's good runs is freed (else a caller that fixes and retries the batch double-frees)."""
    alloc = PageAllocator(16)
    alloc.allocate(16)
    alloc.free([(4, 2)])
    for bad in [[(0, 1), (3, 2)], [(0, 1), (9, 1), (5, 1)], [(0, 2), (8, 2), (14, 3)],
                [(12, 1), (2, 2), (6, 1), (6, 1)]]:
        with pytest.raises(ValueError, match="double free|outside"):
            getattr(alloc, free)(bad)
        alloc.check_invariants()
        assert alloc.free_runs() == [(4, 2)] and alloc.free_pages == 2, bad
    getattr(alloc, free)([(0, 1), (3, 1), (6, 2)])
    assert alloc.free_runs() == [(0, 1), (3, 5)]
