"""The remote tier's records of existence-check hits (a fingerprint, no entry until one is needed)
and its batched bookkeeping, checked against a key-by-key model of what it must do (no store: no
job runs here; the bookkeeping is all loop-thread code)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvtierd.config_remote import RemoteConfig
from kvtierd.protocol import Status
from kvtierd.remote.absent import AbsentCache
from kvtierd.remote.tier import ABSENT_LAYOUTS, ABSENT_TTL_S, RemoteTier
from kvtierd.tiers.chunk import ChunkEntry, ChunkState


class NoArena:  # bookkeeping never touches the arena; jobs (not run here) would
    address = 0
    nbytes = 0


def tier(**kw) -> RemoteTier:
    t = RemoteTier(RemoteConfig(**kw), NoArena(), 65536)
    t.dropped = []
    t.on_drop = t.dropped.append
    return t


SPACE = ("uid:1", "ns", 0)


def key(i: int):
    return (SPACE, b"k%d" % i)


def written(t: RemoteTier, k, nbytes: int, fp: str = "fp") -> ChunkEntry:
    target = t.reserve(k, fp, nbytes, b"\x01" * 16)
    assert target is not None
    t.commit(target)
    return target


def test_an_existence_hit_is_a_record_until_something_needs_its_entry() -> None:
    t = tier()
    keys = [key(i) for i in range(4)]
    t.exists_done(keys, "fp", [True, True, True, False])
    assert all(type(t.known[k]) is str for k in keys[:3]) and keys[3] not in t.known
    # a LOOKUP that leases nothing: hits without entries, the records stay records
    assert t.lookup_many(keys, "fp", entries=False) == [(Status.OK, None)] * 3 + [
        (Status.MISS, None)]
    assert t.lookup_many(keys, "other-layout", entries=False) == [(Status.MISS, None)] * 4
    assert all(type(t.known[k]) is str for k in keys[:3])
    assert list(t.known) == keys[:3]
    # a lease or a GET (lookup): the entry, built in the record's place, READY, size unknown
    status, entry = t.lookup(keys[0], "fp")
    assert status is Status.OK and t.known[keys[0]] is entry
    assert (entry.ikey, entry.fingerprint, entry.nbytes, entry.state) == (
        keys[0], "fp", 0, ChunkState.READY)
    assert t.lookup(keys[0], "fp") == (Status.OK, entry)  # the same entry every time
    assert t.lookup_many(keys[:2], "fp") == [(Status.OK, entry), (Status.OK, t.known[keys[1]])]
    assert isinstance(t.known[keys[1]], ChunkEntry)  # entries=True builds it
    assert list(t.known) == [keys[2], keys[0], keys[1]]  # lookups touch (LRU)
    # a CPU victim's copy is never one whose checksum nobody knows (and asking builds nothing)
    assert not t.holds(keys[2], b"\x01" * 16) and type(t.known[keys[2]]) is str
    written(t, key(8), 100)
    assert t.holds(key(8), b"\x01" * 16) and not t.holds(key(8), b"\x02" * 16)
    # a PUT's peek sees it as held; DELETE removes it as an entry (the chain hears of it)
    assert t.peek(keys[2]).state is ChunkState.READY and t.known[keys[2]] is t.peek(keys[2])
    t.exists_done([key(9)], "fp", [True])
    assert t.delete(key(9)) is Status.OK
    assert [e.ikey for e in t.dropped] == [key(9)] and t.take_deletions() == t.dropped
    assert t.stats()["used_bytes"] == 100
    t.check_invariants()


def test_the_known_bound_evicts_records_and_entries_oldest_first() -> None:
    t = tier(known_keys=4)
    a = written(t, key(0), 1000)
    t.exists_done([key(1), key(2)], "fp", [True, True])
    b = written(t, key(3), 500)
    assert t.stats() == {"capacity_bytes": t.cfg.global_segment_bytes, "used_bytes": 1500,
                         "chunks": 4, "pending_chunks": 0}
    t.lookup(key(0), "fp")  # touched: now the newest
    t.exists_done([key(4), key(5), key(6)], "fp", [True] * 3)  # 1, 2, 3 go, oldest first
    assert list(t.known) == [key(0), key(4), key(5), key(6)] and t.known[key(0)] is a
    assert t.stats()["used_bytes"] == 1000 and t.peek(key(3)) is None and b.ikey == key(3)
    t.exists_done([key(7)], "fp", [True])  # the entry goes as any record
    assert list(t.known) == [key(4), key(5), key(6), key(7)]
    assert t.stats()["used_bytes"] == 0
    t.check_invariants()


def test_a_check_replaces_another_layouts_record_and_keeps_this_layouts_entry() -> None:
    t = tier()
    mine = written(t, key(0), 700)
    theirs = written(t, key(1), 300, fp="old-layout")
    t.exists_done([key(2)], "old-layout", [True])
    t.exists_done([key(0), key(1), key(2), key(3)], "fp", [True] * 4)
    assert t.known[key(0)] is mine  # held for this layout: left as it was, where it was
    assert list(t.known) == [key(0), key(1), key(2), key(3)]
    assert [t.known[key(i)] for i in (1, 2, 3)] == ["fp"] * 3 and theirs.nbytes == 300
    assert t.stats()["used_bytes"] == 700
    t.check_invariants()


def test_a_hit_leaves_the_absent_cache_and_a_miss_is_trusted_for_the_ttl() -> None:
    t = tier()
    now = [10.0]
    t.clock = lambda: now[0]
    t.exists_done([key(0), key(1)], "fp", [False, False])
    assert t.unknown([key(0), key(1), key(2)], "fp") == [key(2)]
    t.exists_done([key(0)], "fp", [True])  # another LOOKUP's check found it since
    assert t.unknown([key(0), key(1)], "fp") == [key(0)]
    now[0] += ABSENT_TTL_S
    assert t.unknown([key(0), key(1)], "fp") == [key(0), key(1)]
    t.check_invariants()


def test_an_absent_answer_for_one_layout_says_nothing_about_another() -> None:
    """Issue 38 item 2: a LOOKUP of K by another layout found its object absent; the right
    layout's reader must still be checked (before, it missed for ABSENT_TTL_S)."""
    t = tier()
    t.clock = lambda: 10.0
    t.exists_done([key(0)], "other-layout", [False])
    assert t.unknown([key(0)], "other-layout") == []
    assert t.unknown([key(0)], "fp") == [key(0)]
    t.exists_done([key(0)], "fp", [True])
    assert t.lookup(key(0), "fp")[0] is Status.OK
    for i in range(ABSENT_LAYOUTS + 3):  # bounded: the least recently asked layout goes
        t.exists_done([key(1)], f"layout-{i}", [False])
    assert t.unknown([key(1)], "layout-0") == [key(1)]
    assert t.unknown([key(1)], f"layout-{ABSENT_LAYOUTS + 2}") == []
    t.check_invariants()


class Model:
    """What the tier's bookkeeping must do, key by key (the first version's loops)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.known: OrderedDict = OrderedDict()  # ikey -> (fingerprint, nbytes)
        # fingerprint -> (ikey -> expiry, in expiry order): an object is named by its layout too
        self.absent: dict[str, OrderedDict] = {}

    def exists_done(self, ikeys, fp, found, now) -> None:
        absent = self.absent.setdefault(fp, OrderedDict())
        for k, hit in zip(ikeys, found):
            absent.pop(k, None)
            if not hit:
                absent[k] = now + ABSENT_TTL_S
                while len(absent) > self.bound:
                    absent.popitem(last=False)
                continue
            held = self.known.get(k)
            if held is None or held[0] != fp:
                self.known.pop(k, None)
                self._remember(k, fp, 0)

    def _remember(self, k, fp, nbytes) -> None:
        self.known[k] = (fp, nbytes)
        while len(self.known) > self.bound:
            self.known.popitem(last=False)

    def lookup(self, k, fp) -> Status:
        held = self.known.get(k)
        if held is None or held[0] != fp:
            return Status.MISS
        self.known.move_to_end(k)
        return Status.OK

    def commit(self, k, fp, nbytes) -> None:
        self.absent.get(fp, {}).pop(k, None)
        self.known.pop(k, None)
        self._remember(k, fp, nbytes)

    def delete(self, k) -> Status:
        return Status.OK if self.known.pop(k, None) is not None else Status.MISS

    def unknown(self, keys, fp, now) -> list:
        absent = self.absent.get(fp, OrderedDict())
        while absent and next(iter(absent.values())) <= now:
            absent.popitem(last=False)
        return [k for k in keys if k not in absent]


@pytest.mark.parametrize("seed", range(12))
def test_batched_bookkeeping_matches_the_key_by_key_model(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.choice([3, 5, 8])
    t, model = tier(known_keys=bound), Model(bound)
    now = [100.0]
    t.clock = lambda: now[0]
    universe = [key(i) for i in range(14)]
    fps = ["fp-a", "fp-b"]
    in_store = {(k, fp): rng.random() < 0.5 for k in universe for fp in fps}
    for step in range(600):
        op = rng.random()
        fp = rng.choice(fps)
        if op < 0.4:
            batch = rng.sample(universe, rng.randint(1, 10))
            found = [in_store[(k, fp)] for k in batch]
            t.exists_done(batch, fp, found)
            model.exists_done(batch, fp, found, now[0])
        elif op < 0.6:
            batch = rng.sample(universe, rng.randint(1, 10))
            entries = rng.random() < 0.5
            got = [s for s, _ in t.lookup_many(batch, fp, entries)]
            assert got == [model.lookup(k, fp) for k in batch], step
        elif op < 0.7:
            k = rng.choice(universe)
            assert t.lookup(k, fp)[0] is model.lookup(k, fp), step
        elif op < 0.8:
            k, nbytes = rng.choice(universe), rng.randint(1, 10**6)
            if t.reserve(k, fp, nbytes, b"\x02" * 16) is None:
                continue  # held for this layout already (the model would not write it either)
            t.commit(t.pending[k])
            model.commit(k, fp, nbytes)
        elif op < 0.85:
            k = rng.choice(universe)
            assert t.delete(k) is model.delete(k), step
        else:
            now[0] += rng.choice([0.0, 0.1, 0.4, 0.7])
            assert t.unknown(universe, fp) == model.unknown(universe, fp, now[0]), step
        assert list(t.known) == list(model.known), step
        assert [t.known[k] if type(t.known[k]) is str else t.known[k].fingerprint
                for k in t.known] == [fp_ for fp_, _ in model.known.values()], step
        assert t.stats()["used_bytes"] == sum(n for _, n in model.known.values()), step
        t.check_invariants()
    t.take_deletions()


def test_absent_cache_keeps_the_newest_within_its_bound_and_prunes_stale_checks() -> None:
    c = AbsentCache(bound=3)
    c.add([1, 2], expiry=11.0, now=10.0)
    c.add([2, 3], expiry=11.5, now=10.5)  # 2 asked again: its expiry is the later one
    c.prune(11.0)
    assert 1 not in c and 2 in c and 3 in c  # the first check's stale 2 is ignored
    c.add([4, 5], expiry=12.0, now=11.0)  # over the bound: the oldest expiries go first
    assert len(c) == 3 and 4 in c and 5 in c and (2 in c) != (3 in c)
    c.discard([4, 9])
    assert 4 not in c and len(c) == 2
    c.check_invariants()
    c.prune(12.0)
    assert len(c) == 0
    c.check_invariants()
