"""Two CPU tiers over real arenas for the batch-primitive tests (tests/unit/kvtierd/tiers/
test_cpu_batch.py, test_cpu_reserved.py): one driven item by item, one a batch at a time, and what
is observable about a tier to compare them by."""

import random
import uuid

import pytest
import xxhash

from kvtierd.protocol import Status
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.cpu import CpuTier

PAGE = 4096
PAGES = 64
SPACE = ("uid:1000", "ns", 0)
OTHER = ("uid:1000", "ns", 1)


@pytest.fixture
def pair(request):
    """Two empty CPU tiers of PAGES pages over real arenas: (item by item, batch)."""
    tiers = []
    for _ in range(2):
        arena = Arena(name=f"kvtierd-test-{uuid.uuid4().hex}", nbytes=PAGES * PAGE,
                      prefault=False, lock=False)
        request.addfinalizer(lambda arena=arena: arena.close(unlink=True))
        tiers.append(CpuTier(arena, PAGE))
    return tiers


def state(tier: CpuTier) -> tuple:
    """Everything observable about a tier's chunks and counters (entries are not compared by
    identity: one tier built them per item, the other per batch)."""
    tier.compact()
    tier.check_invariants()
    reads = tier.index.reads  # reads held by slot count as the references they stand for
    chunks = sorted((ikey, e.state.value, e.nbytes, tuple(e.runs), e.checksum,
                     e.ref_count + reads.get(e.slot, 0), e.pin_count, e.verified)
                    for ikey, e in tier.index.items())
    victims = [tier.index.entry(s).ikey for s in tier.policy.victims()]
    tier.compact()
    return (chunks, victims, tier.allocator.free_runs(), tier.pending_chunks, tier.ready_chunks,
            tier.held_pages, dict(tier.tenant_pages), dict(tier.counters))


def payload_of(key: bytes, nbytes: int) -> bytes:
    return random.Random(key).randbytes(nbytes)


def fill(tier, entries):
    digests = []
    for entry in entries:
        data = payload_of(entry.ikey[1], entry.nbytes)
        pos = 0
        for offset, length in tier.segments(entry):
            tier.arena.view[offset:offset + length] = data[pos:pos + length]
            pos += length
        digests.append(xxhash.xxh3_128_digest(data))
    return digests


def put_each(tier, space, keys, sizes, fp="fp"):
    out = [tier.reserve((space, k), fp, n, owner=1) for k, n in zip(keys, sizes)]
    entries = [e for _, e in out if e is not None]
    for entry, digest in zip(entries, fill(tier, entries)):
        tier.commit(entry, digest)
    return [s for s, _ in out]


def put_batch(tier, space, keys, sizes, fp="fp", fold=False):
    out = tier.reserve_many(space, keys, sizes, fp, owner=1)
    entries = [e for _, e in out if e is not None]
    tier.commit_many(entries, fill(tier, entries), fold=fold)
    if fold:
        assert not any(tier.index.holds(entry) for entry in entries)  # compact at once
        tier.check_invariants()
    return [s for s, _ in out]


def get_each(tier, space, keys, sizes, fp="fp"):
    out = []
    for key, nbytes in zip(keys, sizes):
        status, entry = tier.lookup((space, key), fp)
        if entry is None:
            out.append(int(status))
        elif entry.nbytes != nbytes:
            out.append(int(Status.SIZE_MISMATCH))
        else:
            tier.acquire(entry)
            out.append(entry)
    return out


def delete_each(tier, space, keys, fp="fp"):
    """What the DELETE handler does per key without lower tiers."""
    out = []
    for key in keys:
        status, _ = tier.lookup((space, key), fp)
        out.append(int(status) if status is Status.LAYOUT_MISMATCH
                   else int(tier.delete((space, key))))
    return out


def random_batch(rng, prefix, n, sizes=(PAGE, 2 * PAGE, 3 * PAGE - 7)):
    keys = [f"{prefix}-{rng.randrange(3 * n)}".encode() for _ in range(n)]  # repeats on purpose
    size = rng.choice(sizes)
    return keys, [size if rng.random() < 0.9 else rng.choice(sizes) for _ in keys]


class Reads:
    """A GET's holds in both tiers: entries acquired item by item in one, what acquire_slots
    held (slots, and entries for chunks it does not hold by slot) in the other."""

    def __init__(self, each, batch, space, keys, sizes, fp):
        self.each, self.batch = each, batch
        self.got_each = get_each(each, space, keys, sizes, fp)
        self.got_batch, self.slots, self.pages = batch.acquire_slots(space, keys, sizes, fp)
        self.keys, self.sizes = keys, sizes

    def outcomes(self):
        each = [x if type(x) is int else "hit" for x in self.got_each]
        batch = [-x if type(x) is int and x < 0 else "hit" for x in self.got_batch]
        return each, batch

    def check_bytes(self):
        """The bytes under every hold are the ones put, in both tiers."""
        for tier, got in ((self.each, self.got_each), (self.batch, self.got_batch)):
            for key, nbytes, x in zip(self.keys, self.sizes, got):
                if type(x) is int and (tier is self.each or x < 0):
                    continue
                segs = [(x, nbytes)] if type(x) is int else tier.segments(x)
                data = b"".join(bytes(tier.arena.view[o:o + n]) for o, n in segs)
                assert data == payload_of(key, nbytes)

    def release(self):
        for entry in self.got_each:
            if type(entry) is not int:
                self.each.release(entry)
        entries = [x for x in self.got_batch if type(x) is not int]
        self.batch.release_slots(self.slots, self.pages)
        assert self.batch.release_read(entries) == sum(e.nbytes for e in entries)


def python_columns(monkeypatch) -> None:
    """Make the index read and write its columns with ``kvtierd.tiers.columns``' Python loops,
    as where ``kvtierd.tiers._columns`` was not built."""
    from kvtierd.tiers import base, columns, cpu_batch, index_batch  # noqa: PLC0415

    for name in ("fill_at", "put_at", "put_records_at", "take_at"):
        monkeypatch.setattr(index_batch, name, getattr(columns, f"{name}_python"))
    for module in (cpu_batch, base):
        monkeypatch.setattr(module, "take_at", columns.take_at_python)
