"""PUT and GET batches over shared staging with an NVMe tier below, as a default deployment runs.

Such batches take the columnar fast path (``kvtierd.server.fast_path``) even with a tier below:
a PUT batch of which no lower tier holds a key is reserved as columns (by slot, since a
write-back tier takes chunks only when they are evicted), any other goes item by item and is
answered from below; a GET batch is looked up as columns in the arena and its misses go on to
the tiers below. These pin down that each item gets the answer the per-item path gives it, and
that loads are byte-exact into poisoned staging while misses leave their bytes poisoned. A DELETE
batch of keys that only the arena holds leaves as a batch too, any other key by key.
"""

from __future__ import annotations

import functools
import random

import pytest
from helpers.bad_input import Session, names, namespace
from helpers.daemon import WITHOUT_COMPILED_PARTS
from helpers.nvme import metric, wait_settled

from kvtierd.protocol import Op, Tier

pytestmark = pytest.mark.timeout(120)

PAGE = 64 * 1024  # the daemon's default page
CHUNK = PAGE - 300  # ends inside its page
POISON = 0xD3
STORED = 160  # 160 pages against the arena's 64: most of them are demoted to NVMe


@pytest.fixture(params=["compiled", "python"])
def daemon_factory(daemon_factory, request):
    """Daemons with an NVMe tier, running the compiled parts or (as a build without a C compiler
    would) their Python forms: every batch path below runs both ways."""
    launcher = WITHOUT_COMPILED_PARTS if request.param == "python" else None
    return functools.partial(daemon_factory, nvme_bytes="64MiB", launcher=launcher)


def put_all(session: Session, staging, keys: list[bytes], data: dict[bytes, bytes],
            per_batch: int = 32) -> list[str]:
    """PUT ``keys`` from staging, ``per_batch`` per request (the arena holds 64 pages)."""
    out: list[str] = []
    for first in range(0, len(keys), per_batch):
        part = keys[first:first + per_batch]
        for i, key in enumerate(part):
            staging.write(i * CHUNK, data[key])
        out += names(session.put([[key, i * CHUNK, CHUNK] for i, key in enumerate(part)])
                     ["results"])
    return out


def delete(session: Session, keys: list[bytes]) -> list[str]:
    reply, _ = session.request(Op.DELETE, keys=keys)
    assert reply["name"] == "OK" and len(reply["results"]) == len(keys), reply
    return names(reply["results"])


def test_put_get_delete_batches_with_chunks_in_the_arena_on_nvme_and_nowhere(daemon_factory,
                                                                                memfd):
    d = daemon_factory(cpu_bytes="4MiB")
    rng = random.Random(48)
    staging = memfd(64 * CHUNK, fill=POISON)
    space = namespace()
    session = Session(d.address, space, staging=staging)
    keys = [f"chain-{i}".encode() for i in range(STORED)]
    data = {key: rng.randbytes(CHUNK) for key in keys}
    assert put_all(session, staging, keys, data) == ["OK"] * STORED
    wait_settled(d)
    tiers = dict(zip(keys, session.lookup(keys)))
    in_arena = [k for k in keys if tiers[k] == Tier.CPU]
    on_nvme = [k for k in keys if tiers[k] == Tier.NVME]
    assert len(in_arena) + len(on_nvme) == STORED and len(on_nvme) >= STORED - 64, tiers

    # PUT: a batch holding keys that only NVMe has goes item by item, answered from below
    # (EXISTS, or SIZE_MISMATCH for another size); its new keys are stored
    new = [f"new-{i}".encode() for i in range(4)]
    data.update({key: rng.randbytes(CHUNK) for key in new})
    mixed = [on_nvme[0], new[0], on_nvme[1], new[1]]
    for i, key in enumerate(mixed):
        staging.write(i * CHUNK, data[key])
    items = [[key, i * CHUNK, CHUNK] for i, key in enumerate(mixed)]
    items[2][2] = CHUNK - 1
    assert names(session.put(items)["results"]) == ["EXISTS", "OK", "SIZE_MISMATCH", "OK"]
    # a batch of new keys only: the fast path, reserved by slot
    for i, key in enumerate(new[2:]):
        staging.write(i * CHUNK, data[key])
    assert names(session.put([[key, i * CHUNK, CHUNK] for i, key in enumerate(new[2:])])
                 ["results"]) == ["OK", "OK"]
    wait_settled(d)

    # GET: arena hits, NVMe-only chunks (promoted) and misses in one batch, byte for byte
    tiers = dict(zip(keys + new, session.lookup(keys + new)))
    hits = [k for k in keys + new if tiers[k] == Tier.CPU][:6]
    below = [k for k in keys if tiers[k] == Tier.NVME][:6]
    missing = [b"never-stored-1", b"never-stored-2"]
    want = [hits[0], below[0], missing[0], *hits[1:], *below[1:], missing[1]]
    assert len(hits) == len(below) == 6
    promotions = metric(d.metrics_text(), "kvtierd_promotions_total")
    staging.fill(POISON)
    reply, _ = session.get([[key, i * CHUNK, CHUNK] for i, key in enumerate(want)])
    assert names(reply["results"]) == ["MISS" if key in missing else "OK" for key in want]
    for i, key in enumerate(want):
        got = staging.read(i * CHUNK, CHUNK)
        assert got == (bytes([POISON]) * CHUNK if key in missing else data[key]), key
    assert metric(d.metrics_text(), "kvtierd_promotions_total") >= promotions + len(below)
    assert set(session.lookup(below)) == {Tier.CPU}  # promoted into the arena

    # DELETE: keys only the arena holds leave as a batch (a reader of another layout is refused
    # and changes nothing); keys also held below go key by key, from every tier
    wait_settled(d)
    tiers = dict(zip(keys + new, session.lookup(keys + new)))
    arena_only = [k for k in new if tiers[k] == Tier.CPU][:2]
    assert len(arena_only) == 2, tiers
    other = Session(d.address, space, staging=memfd(CHUNK), fingerprint="fp-other-layout")
    assert delete(other, arena_only) == ["LAYOUT_MISMATCH"] * 2
    assert delete(session, arena_only) == ["OK", "OK"]
    on_nvme = [k for k in keys if tiers[k] == Tier.NVME][:2]
    assert delete(session, [on_nvme[0], below[0], b"never-stored-3"]) == ["OK", "OK", "MISS"]
    wait_settled(d)
    assert session.lookup(arena_only + on_nvme[:1] + below[:1]) == [0] * 4
    assert session.lookup(on_nvme[1:]) == [Tier.NVME]  # a neighbour below is untouched
    other.close()
    session.close()
    d.check()
    ready = next(line for line in d.log().splitlines() if " ready on " in line)
    compiled = d.launcher is not WITHOUT_COMPILED_PARTS
    form = "compiled" if compiled else "python"
    assert all(f"{part}: {form}" in ready for part in ("index columns", "request items",
                                                         "lru stamps", "ghost sampling",
                                                         "ghosts")), ready
    assert ("host copies: compiled copies and xxh3" if compiled else "host copies: ctypes") in ready
