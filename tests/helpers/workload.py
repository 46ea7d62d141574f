"""A small real workload for the operations tests, and where the deploy/ files are."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier_client import KVTierClient

from .kv import random_kv, random_tokens, simple_layout

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def run_workload(address: str, seed: int = 5) -> dict[str, int]:
    """Store, look up and load a few prompts so that hits, misses, evictions and bytes all move.

    The daemon should have a small CPU tier (4 MiB): the second half of the prompts evicts part of
    the first. Returns what the client saw: ``lookups`` keys looked up, ``hits`` of them found,
    ``gets`` chunks loaded, ``served`` of them served."""
    layout = simple_layout(page_bytes=16000, layers=2, blocks_per_chunk=4, model="ops")
    gen = torch.Generator().manual_seed(seed)
    sizes = [10, 10, 20, 20]
    kv = random_kv(layout, [100 * len(sizes) + 100], gen)
    plans = [layout.plan(random_tokens(gen, n * 64 + 3), [list(range(100 * p, 100 * (p + 1)))])
             for p, n in enumerate(sizes)]
    never = layout.plan(random_tokens(gen, 5 * 64), [list(range(400, 480))])
    with KVTierClient.connect(address, layout=layout, kv_caches=kv) as client:
        for chunks in [plans[0], plans[1], plans[0], plans[2], plans[3]]:
            assert all(client.store(chunks).result(timeout=30))
        flat = [c for chunks in plans for c in chunks]
        looked = client.lookup(flat) + client.lookup(never)
        loaded = client.load(flat).result(timeout=30)
    return {"lookups": len(looked), "hits": sum(looked), "gets": len(loaded),
            "served": sum(loaded)}


def engine_half_hits(address: str, requests: int = 4, seed: int = 6) -> dict[str, int]:
    """Engine-style traffic whose lookups hit exactly half the time.

    Each request has a 4-chunk prefix some earlier request stored and 4 new chunks. As vLLM's
    connector does, it looks up every chunk (leasing the hits) and loads only the hits; the chunks
    are stored beforehand, so no probe of a store adds LOOKUPs. Returns what the client saw."""
    layout = simple_layout(page_bytes=16000, layers=2, blocks_per_chunk=4, model="engine")
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv(layout, [40 * requests], gen)
    plans = [layout.plan(random_tokens(gen, 8 * 64 + 3), [list(range(40 * r, 40 * (r + 1)))])
             for r in range(requests)]
    assert all(len(p) == 8 for p in plans)
    hits = lookups = served = 0
    with KVTierClient.connect(address, layout=layout, kv_caches=kv) as client:
        assert all(client.store([c for p in plans for c in p[:4]]).result(timeout=30))
        for chunks in plans:
            found = client.lookup(chunks, lease=True)
            assert found == [True] * 4 + [False] * 4, found
            loaded = client.load([c for c, f in zip(chunks, found) if f]).result(timeout=30)
            hits, lookups, served = hits + sum(found), lookups + len(found), served + sum(loaded)
    return {"hits": hits, "lookups": lookups, "served": served}
