"""Cascading through the real tier chain (``helpers.chain_stack``): what NVMe evicts goes on to an
on-evict remote through the arena's bounce pages, victims wait for those pages instead of being
dropped, and every victim that is dropped anyway is counted with its reason."""

from __future__ import annotations

import pytest

from helpers import chain_stack
from helpers.chain_stack import COMMIT, EVICT, SPACE, Stack
from kvtierd.tiers.lower import PublishPolicy


@pytest.fixture
def make(tmp_path):
    yield from chain_stack.stacks(tmp_path)


def remote_only(s: Stack, payloads: dict[bytes, bytes]) -> set[bytes]:
    """Every chunk of ``payloads`` is on NVMe or the remote (none lost), and each one only on the
    remote promotes back byte-exact (then leaves the arena, to make room); returns those keys."""
    on_nvme = {k for k in payloads if s.nvme.peek((SPACE, k)) is not None}
    on_remote = {k for k in payloads if s.remote.peek((SPACE, k)) is not None}
    lost = set(payloads) - on_nvme - on_remote
    assert not lost, f"chunks lost: {sorted(lost)}"
    for key in sorted(on_remote - on_nvme):
        ok, data = s.promote(key, len(payloads[key]))
        assert ok and data == payloads[key], key
        s.cpu.delete((SPACE, key))  # room for the next one
    s.invariants()
    return on_remote - on_nvme


def cascaded_losing_nothing(s: Stack, bounce_pages: int) -> None:
    """Chunks cascaded to the remote, every bounce page came back, and no victim was dropped."""
    assert s.metric("kvtierd_bytes_total", direction="cascade", tier="remote") > 0
    assert s.chain.bounce.allocator.free_pages == bounce_pages, "bounce pages not given back"
    assert s.dropped() == {}


def test_what_nvme_evicts_cascades_to_an_on_evict_remote(make):
    """With the remote on-evict, a chunk leaving NVMe (full) is not lost: it is read into the
    arena's bounce slice (verified), written to the remote, and NVMe's pages come free after.
    While its victims are held, the chunk that needed NVMe's room goes to the remote itself."""
    s = make(remote_policy=PublishPolicy(EVICT), pages=128, cascade_pages=8, nvme_pages=12)
    assert s.cpu.set_aside_runs and s.chain.bounce.pages == 8
    payloads = {}
    for i in range(10):  # three-page chunks: NVMe holds four
        key = b"c%d" % i
        payloads[key] = s.put(key)
        s.evict_all()
        s.invariants()
    assert s.nvme.counters["evictions"] > 0
    cascaded_losing_nothing(s, 8)
    on_remote = {k for k in payloads if s.remote.peek((SPACE, k)) is not None}
    cascaded = {k for k in on_remote if ("dropped", "nvme", k) in s.events.log}
    assert cascaded and all(("stored", "remote", k) in s.events.log for k in cascaded)
    assert on_remote - cascaded, "no chunk went to the remote while NVMe's victims were held"
    remote_only(s, payloads)


def test_victims_wait_for_the_bounce_pages_instead_of_being_dropped(make):
    """Under pressure (many NVMe victims in one loop turn, bounce pages for one chunk), NVMe does
    not evict what it cannot cascade yet: the victim stays and the chunk that needed its room goes
    to the remote itself. So no chunk is lost, and the deferral is counted."""
    s = make(remote_policy=PublishPolicy(EVICT), pages=128, cascade_pages=3, nvme_pages=12)
    assert s.chain.bounce.pages == 3  # one three-page chunk at a time
    payloads = {}
    for rnd in range(5):
        for i in range(4):  # four CPU victims in one turn: each needs NVMe's room
            key = b"r%dc%d" % (rnd, i)
            payloads[key] = s.put(key)
        s.evict_all()
        s.invariants()
    assert s.nvme.counters["evictions_deferred"] > 0
    cascaded_losing_nothing(s, 3)
    remote_only(s, payloads)


def test_a_victim_larger_than_the_bounce_pages_is_dropped_not_kept(make):
    """A chunk that can never fit the bounce slice is evicted as before (NVMe would otherwise
    never free its room)."""
    s = make(remote_policy=PublishPolicy(EVICT), pages=128, cascade_pages=2, nvme_pages=12)
    for i in range(6):
        s.put(b"big%d" % i)  # three pages each: never fits two bounce pages
        s.evict_all()
        s.invariants()
    assert s.nvme.counters["evictions"] > 0 and s.nvme.counters["evictions_deferred"] == 0
    assert s.metric("kvtierd_bytes_total", direction="cascade", tier="remote") == 0
    assert s.dropped() == {("nvme", "too_large"): s.nvme.counters["evictions"]}


def test_nvme_victims_an_unusable_remote_cannot_take_are_counted_as_dropped(make):
    """The remote on-evict but down: NVMe evicts as it would without it (never stalls), and each
    victim counts as dropped: first the writes that fail (the remote cut off), then, with its
    circuit open, the victims it is not asked to take."""
    s = make(remote_policy=PublishPolicy(EVICT), pages=128, cascade_pages=8, nvme_pages=12)
    s.remote.cut()
    for i in range(10):  # three-page chunks: NVMe holds four
        s.put(b"d%d" % i)
        s.evict_all()
        s.invariants()
    evicted = s.nvme.counters["evictions"]
    dropped = s.dropped()
    assert evicted > 1 and s.nvme.counters["evictions_deferred"] == 0
    from_nvme = {why: n for (tier, why), n in dropped.items() if tier == "nvme"}
    assert set(from_nvme) == {"write_failed", "below_unavailable"}, dropped
    assert sum(from_nvme.values()) == evicted
    # chunks that went to the remote themselves while NVMe's victims were held failed there too
    assert set(dropped) - {("nvme", why) for why in from_nvme} <= {("cpu", "write_failed")}
    assert s.chain.bounce.allocator.free_pages == 8, "bounce pages not given back"
    assert s.remote.stats()["chunks"] == 0


def test_no_cascade_without_an_on_evict_tier_below(make):
    s = make(remote_policy=PublishPolicy(COMMIT), pages=128, cascade_pages=8)
    assert s.chain.bounce is None and not s.cpu.set_aside_runs
