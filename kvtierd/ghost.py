"""Capacity planning: ghost caches that tell what hit ratio each tier would have if it were larger.

A ghost cache is a keys-only simulation of the tier's eviction policy (LRU) over the same accesses
the daemon sees, at a larger capacity: it remembers which keys a bigger tier would still hold and
their sizes, never their bytes. Per tier there is one ghost per scale (2x and 4x by default).

What is simulated, per tier, at scale ``s``: an LRU cache of ``base + s * capacity`` bytes, where
``base`` is the capacity of the faster tiers in front of it (0 for the CPU tier). For the CPU tier
that is "this node's CPU tier, s times bigger"; for a tier behind it (NVMe) it is the whole hierarchy
down to that tier with that tier s times bigger — which is what a demoting hierarchy behaves like.

The feed (from the request handlers, on the request loop, O(1) per key):

* ``access(ikey, hit_tier)`` for every key of a LOOKUP, hit or miss: one chunk request of the
  engine, counted as ``kvtierd_hits_total`` / ``kvtierd_misses_total`` count it. Each tier counts the
  access, the real outcome (scale 1: a hit in this tier or a faster one) and the outcome in each
  ghost. A miss inserts nothing: as in the real cache, only a PUT does.
* ``touch(ikey)`` for every GET item: the read makes the key most recent in the ghosts, as it does
  in the tier, but is not counted again (the LOOKUP before it was the request).
* ``insert(ikey, nbytes)`` for every PUT item that was committed or already stored (``EXISTS``).
* ``remove(ikey)`` for every deleted key.

PUT and GET feed them once per batch (``insert_many`` / ``touch_many``: the keys of one session's
key space, in item order), which is the same sequence of per-key updates without a Python call per
key and ghost: at 16 KiB chunks the per-key calls were a fifth of the daemon's time per item.

The hit ratio tier ``t`` would have at scale ``s`` is ``hits[t][s] / accesses[t]``; scale 1 is the
real tier, measured on the same accesses, so the three numbers compare directly. Known optimism:
ghosts are plain LRU filled to 100 %, while the real tier keeps leased chunks and evicts down to its
low watermark.

Memory: a ghost entry costs about 40 bytes in ``kvtierd._ghost`` (compiled: a 64-bit key hash, a
page count and two links in flat arrays, and a half-full table), about 140 as the Python form's
``OrderedDict`` node (``tests/unit/kvtierd/test_ghost.py`` measures both), so a tier's ghosts hold
at most ``1.5 * MAX_KEYS`` entries (about 2 MB compiled, 7 MB in Python). A tier so large that its
4x ghost could hold more keys than ``MAX_KEYS`` (counting one page per chunk, the worst case) is
simulated on a sample of the key space (spatial sampling, as in SHARDS: a key is simulated iff its
64-bit hash is below ``sample_ratio * 2**64``, and the ghost capacities shrink by the same ratio);
its counters then count the sampled accesses only, and their ratios estimate the hit ratios. Small
tiers are simulated exactly (``sample_ratio`` 1). The sample is deterministic: xxh3 of the key,
seeded by its key space, so the same keys are sampled in every process and run.

Cost, and why ``MAX_KEYS`` is 32768: a LOOKUP batch hashes every key (one C loop) and compares it
with each tier's threshold; only the sampled keys go into the ghosts, and a ghost access is a table
lookup and a relink (in the Python form an ``OrderedDict`` lookup and move, ~0.2-0.5 µs a key and
ghost on the shared test machine, cache misses included). With 131072 keys a 100k-chunk tier sampled
a quarter of its keys and the ghosts cost more than the index lookup itself; at 32768 it is 1/15
there and 1/150 at a million chunks, and the largest ghost still holds up to 32768 distinct keys,
where SHARDS-style estimates are within a point or two (``tests/unit/kvtierd/test_ghost_batch.py``
checks the estimate against an exact simulation).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from functools import lru_cache
from itertools import compress, repeat
from typing import Hashable, Iterable, Sequence

import xxhash
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtierd import key_sample

SCALES = (2, 4)
MAX_KEYS = 1 << 15  # keys in a tier's largest ghost before it samples (~1.4 MB at ~40 B a key)
_SAMPLE_BITS = 64  # a key is sampled iff its 64-bit hash is below ratio * 2**64


@lru_cache(maxsize=1024)
def _space_seed(tenant: str, namespace: str, rank: int) -> int:
    return xxhash.xxh3_64_intdigest(
        f"{tenant}\0{namespace}\0{rank}".encode("utf-8", "surrogatepass"))


class GhostLRUPython:
    """A keys-only LRU bounded by bytes: key hash -> pages, coldest first. The Python form of
    ``kvtierd._ghost.LRU``: that one runs where the extension was built (the same answers and
    order, about a quarter of the memory, a fraction of the time per key), this one where it was
    not; the tests run both."""

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        self.capacity_pages = capacity_bytes // page_bytes
        self.page_bytes = page_bytes
        self.used_pages = 0
        self._order: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: int) -> bool:
        return key in self._order

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    def access(self, key: int) -> bool:
        """A read of ``key``: True (and most recent) if the ghost holds it."""
        if key in self._order:
            self._order.move_to_end(key)
            return True
        return False

    def access_many(self, keys: Iterable[int]) -> int:
        """``access`` for each key, in order; returns how many hit. A read never inserts, so
        which keys hit is known before any moves: two C loops instead of a call per key."""
        order = self._order
        held = list(filter(order.__contains__, keys))
        deque(map(order.move_to_end, held), 0)
        return len(held)

    def insert(self, key: int, pages: int) -> None:
        """A store of ``key``: held (most recent) with ``pages``; the coldest keys make room."""
        old = self._order.pop(key, None)
        if old is not None:
            self.used_pages -= old
        if pages > self.capacity_pages:
            return  # larger than the whole ghost: the real tier would refuse it too
        self._order[key] = pages
        self.used_pages += pages
        while self.used_pages > self.capacity_pages:
            _, freed = self._order.popitem(last=False)
            self.used_pages -= freed

    def touch_many(self, keys: Iterable[int]) -> None:
        """``access`` for each key, without counting: most recent if held (``access_many``'s
        two C loops)."""
        self.access_many(keys)

    def insert_many(self, keys: Iterable[int], pages: Iterable[int]) -> None:
        """``insert`` for each (key, pages), in order."""
        order = self._order
        capacity = self.capacity_pages
        used = self.used_pages
        if (type(keys) is list and len(set(keys)) == len(keys) and order.keys().isdisjoint(keys)
                and max(pages, default=0) <= capacity):
            # New, distinct keys that each fit (a fresh PUT batch): appended in one C call, then
            # the coldest keys leave until the rest fits. The same order and pages as one insert
            # at a time: what those evict is always a prefix, the shortest one that leaves the
            # rest within capacity, which only grows as keys are added.
            order.update(zip(keys, pages))
            used += sum(pages)
            while used > capacity:
                used -= order.popitem(last=False)[1]
            self.used_pages = used
            return
        for key, n in zip(keys, pages):
            old = order.pop(key, None)
            if old is not None:
                used -= old
            if n > capacity:
                continue
            order[key] = n
            used += n
            while used > capacity:
                used -= order.popitem(last=False)[1]
        self.used_pages = used

    def remove(self, key: int) -> None:
        pages = self._order.pop(key, None)
        if pages is not None:
            self.used_pages -= pages

    def remove_many(self, keys: Iterable[int]) -> None:
        self.used_pages -= sum(map(self._order.pop, keys, repeat(0)))

    def items(self) -> list[tuple[int, int]]:
        """(key, pages), coldest first."""
        return list(self._order.items())

    def check_invariants(self) -> None:
        assert self.used_pages == sum(self._order.values()), "ghost page count drifted"
        assert self.used_pages <= self.capacity_pages, "ghost above its capacity"


try:
    from kvtierd._ghost import LRU as GhostLRU
    NATIVE = "compiled"
except ImportError:  # built without a C compiler: the same ghosts, slower and larger
    GhostLRU = GhostLRUPython
    NATIVE = "python"


class TierGhosts:
    """The ghosts of one tier (one per scale) and its counters."""

    def __init__(self, tier: str, depth: int, base_bytes: int, capacity_bytes: int,
                 page_bytes: int, scales: Sequence[int] = SCALES, max_keys: int = MAX_KEYS) -> None:
        self.tier = tier
        self.depth = depth  # 0 = fastest tier; a real hit in any tier at depth <= this one counts
        self.scales = tuple(scales)
        self.capacity_bytes = {s: base_bytes + s * capacity_bytes for s in (1, *self.scales)}
        worst_keys = self.capacity_bytes[max(self.scales)] // page_bytes
        self.sample_ratio = min(1.0, max_keys / worst_keys) if worst_keys else 1.0
        self._threshold = int(self.sample_ratio * (1 << _SAMPLE_BITS))  # 1 << 64: every key
        self.ghosts = {
            s: GhostLRU(int(self.capacity_bytes[s] * self.sample_ratio), page_bytes)
            for s in self.scales
        }
        self.accesses = 0
        self.hits = {s: 0 for s in (1, *self.scales)}

    def sampled(self, key: int) -> bool:
        return key < self._threshold

    def own(self, hashes: list[int], top: int) -> list[int]:
        """Of ``hashes`` sampled against ``top`` (the largest tier threshold), those this tier
        samples: all of them at the largest threshold (the samples are nested)."""
        threshold = self._threshold
        return hashes if threshold >= top else [h for h in hashes if h < threshold]

    def stats(self) -> dict:
        return {
            "depth": self.depth,
            "sample_ratio": self.sample_ratio,
            "accesses": self.accesses,
            "hits": {str(s): n for s, n in self.hits.items()},
            "capacity_bytes": {str(s): n for s, n in self.capacity_bytes.items()},
            "keys": {str(s): len(g) for s, g in self.ghosts.items()},
        }


class GhostCaches:
    """Ghosts for every tier, fastest first; fed by the request handlers."""

    def __init__(self, tiers: Iterable[tuple[str, int]], page_bytes: int,
                 scales: Sequence[int] = SCALES, max_keys: int = MAX_KEYS) -> None:
        self.page_bytes = page_bytes
        self.tiers: list[TierGhosts] = []
        self._depth: dict[str, int] = {}
        base = 0
        for depth, (name, capacity_bytes) in enumerate(tiers):
            self.tiers.append(
                TierGhosts(name, depth, base, capacity_bytes, page_bytes, scales, max_keys))
            self._depth[name] = depth
            base += capacity_bytes
        # The largest sampling threshold: a batch is sampled against it once (access_uniform).
        self._top_threshold = max((tier._threshold for tier in self.tiers), default=0)

    @staticmethod
    def key(ikey: Hashable) -> int:
        """64-bit xxh3 of ``((tenant, namespace, rank), key)``: uniform (sampling uses its low bits)
        and the same in every process, so a sample is reproducible across restarts and in tests.
        The tenant is in the seed: two tenants' equal keys are two ghost entries, as in the tiers."""
        (tenant, namespace, rank), key = ikey
        return xxhash.xxh3_64_intdigest(key, seed=_space_seed(tenant, namespace, rank))

    def access(self, ikey: Hashable, hit_tier: str | None) -> None:
        """One LOOKUP key; ``hit_tier`` is the tier that really had it (None: miss)."""
        key = self.key(ikey)
        real = self._depth.get(hit_tier, -1) if hit_tier is not None else -1
        for tier in self.tiers:
            if not tier.sampled(key):
                continue
            tier.accesses += 1
            if 0 <= real <= tier.depth:
                tier.hits[1] += 1
            for scale, ghost in tier.ghosts.items():
                if ghost.access(key):
                    tier.hits[scale] += 1

    def access_many(self, space: tuple[str, str, int], keys: Sequence[bytes],
                    hit_tiers: Sequence[str | None]) -> None:
        """``access`` for every key of one LOOKUP batch (one key space), in order: the same
        counts and ghost updates. A LOOKUP must answer ~1M keys/s, so the per-key work is one
        hash and one comparison (``key_sample``, one C loop); only the sampled keys (every key
        of a small tier, ~1/150 at a million chunks) go into the ghosts, in C loops
        (``GhostLRU.access_many``). A batch with one outcome for every key (all CPU hits, say)
        counts its real hits without looking at the keys."""
        n = len(keys)
        if not self.tiers or not n:
            return
        first = hit_tiers[0]
        if hit_tiers.count(first) == n:
            self.access_uniform(space, keys, first)
            return
        top = self._top_threshold
        sampled, at = key_sample.below_at(keys, _space_seed(*space), top)
        sampled_hits = [hit_tiers[i] for i in at]
        for tier in self.tiers:
            threshold = tier._threshold
            mine = tier.own(sampled, top)
            if not mine:
                continue
            tier.accesses += len(mine)
            faster = {name for name, d in self._depth.items() if d <= tier.depth}
            tier.hits[1] += sum(1 for h, hit in zip(sampled, sampled_hits)
                                if h < threshold and hit in faster)
            for scale, ghost in tier.ghosts.items():
                tier.hits[scale] += ghost.access_many(mine)

    def access_uniform(self, space: tuple[str, str, int], keys: Sequence[bytes],
                       hit_tier: str | None) -> None:
        """``access_many`` of a batch with one outcome for every key (all CPU hits, say): its
        real hits are counted without looking at the keys, and the keys are hashed and sampled
        in one pass against the largest threshold (no list of every hash); each tier then
        samples from those few (the tiers' samples are nested: a key below a smaller
        threshold is below the largest)."""
        n = len(keys)
        if not self.tiers or not n:
            return
        top = self._top_threshold
        sampled = key_sample.below(keys, _space_seed(*space), top)
        real = self._depth.get(hit_tier, -1) if hit_tier is not None else -1
        for tier in self.tiers:
            mine = tier.own(sampled, top)
            if not mine:
                continue
            tier.accesses += len(mine)
            if 0 <= real <= tier.depth:
                tier.hits[1] += len(mine)
            for scale, ghost in tier.ghosts.items():
                tier.hits[scale] += ghost.access_many(mine)

    def touch(self, ikey: Hashable) -> None:
        """One GET item: most recent in every ghost that holds it; no access is counted."""
        key = self.key(ikey)
        for tier in self.tiers:
            if tier.sampled(key):
                for ghost in tier.ghosts.values():
                    ghost.access(key)

    def insert(self, ikey: Hashable, nbytes: int) -> None:
        """A PUT item that was committed or already stored."""
        key = self.key(ikey)
        pages = max(1, -(-nbytes // self.page_bytes))
        for tier in self.tiers:
            if tier.sampled(key):
                for ghost in tier.ghosts.values():
                    ghost.insert(key, pages)

    def touch_many(self, space: tuple[str, str, int], keys: Sequence[bytes]) -> None:
        """``touch`` for every key of one GET batch (one session's ``space``), in order."""
        if not self.tiers or not keys:
            return
        top = self._top_threshold
        sampled = key_sample.below(keys, _space_seed(*space), top)
        for tier in self.tiers:
            mine = tier.own(sampled, top)
            for ghost in tier.ghosts.values():
                ghost.touch_many(mine)

    def insert_many(self, space: tuple[str, str, int], keys: Sequence[bytes],
                    nbytes: Sequence[int]) -> None:
        """``insert`` for every (key, nbytes) of one PUT batch (one session's ``space``), in order."""
        if not self.tiers or not keys:
            return
        top = self._top_threshold
        sampled, at = key_sample.below_at(keys, _space_seed(*space), top)
        page = self.page_bytes
        one_size = nbytes and nbytes.count(nbytes[0]) == len(nbytes)  # most batches
        if one_size:
            pages = [max(1, -(-nbytes[0] // page))] * len(sampled)
        else:
            pages = [max(1, -(-nbytes[i] // page)) for i in at]
        for tier in self.tiers:
            threshold = tier._threshold
            if threshold >= top:
                tier_keys, tier_pages = sampled, pages
            else:
                mask = [h < threshold for h in sampled]
                tier_keys = list(compress(sampled, mask))
                tier_pages = (pages[:len(tier_keys)] if one_size
                              else list(compress(pages, mask)))
            for ghost in tier.ghosts.values():
                ghost.insert_many(tier_keys, tier_pages)

    def remove(self, ikey: Hashable) -> None:
        key = self.key(ikey)
        for tier in self.tiers:
            for ghost in tier.ghosts.values():
                ghost.remove(key)

    def remove_many(self, space: tuple[str, str, int], keys: Sequence[bytes]) -> None:
        """``remove`` for every key of one DELETE batch (one session's ``space``). Only sampled
        keys can be in a ghost, so each tier removes only those (a large tier samples 1/8 or
        fewer: the other pops would all miss)."""
        if not self.tiers or not keys:
            return
        top = self._top_threshold
        sampled = key_sample.below(keys, _space_seed(*space), top)
        for tier in self.tiers:
            mine = tier.own(sampled, top)
            for ghost in tier.ghosts.values():
                ghost.remove_many(mine)

    def stats(self) -> dict[str, dict]:
        return {tier.tier: tier.stats() for tier in self.tiers}

    def check_invariants(self) -> None:
        for tier in self.tiers:
            assert all(tier.hits[s] <= tier.accesses for s in tier.hits), "more hits than accesses"
            for ghost in tier.ghosts.values():
                ghost.check_invariants()


class GhostCollector(Collector):
    """Exports the ghosts' counters at scrape time (nothing on the request path)."""

    def __init__(self, ghosts: GhostCaches) -> None:
        self._ghosts = ghosts

    def collect(self):
        accesses = CounterMetricFamily(
            "kvtierd_ghost_accesses",
            "LOOKUP keys (chunk requests) the capacity-planning ghosts of a tier saw",
            labels=["tier"],
        )
        hits = CounterMetricFamily(
            "kvtierd_ghost_hits",
            "Of those accesses, hits the tier would have at `scale` times its capacity "
            "(scale 1: real hits in this tier or a faster one)",
            labels=["tier", "scale"],
        )
        capacity = GaugeMetricFamily(
            "kvtierd_ghost_capacity_bytes",
            "Capacity simulated at each scale (faster tiers + scale * this tier)",
            labels=["tier", "scale"],
        )
        keys = GaugeMetricFamily(
            "kvtierd_ghost_keys", "Keys a ghost holds (about 40 bytes of daemon memory each)",
            labels=["tier", "scale"],
        )
        ratio = GaugeMetricFamily(
            "kvtierd_ghost_sample_ratio",
            "Fraction of the key space a tier's ghosts simulate (a deterministic hash sample of "
            "the keys; 1 = every key)",
            labels=["tier"],
        )
        for tier in self._ghosts.tiers:
            accesses.add_metric([tier.tier], tier.accesses)
            ratio.add_metric([tier.tier], tier.sample_ratio)
            for scale, count in tier.hits.items():
                hits.add_metric([tier.tier, str(scale)], count)
                capacity.add_metric([tier.tier, str(scale)], tier.capacity_bytes[scale])
            for scale, ghost in tier.ghosts.items():
                keys.add_metric([tier.tier, str(scale)], len(ghost))
        yield from (accesses, hits, capacity, keys, ratio)
