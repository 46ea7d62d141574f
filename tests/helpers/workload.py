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
    the first. Returns what the client saw."""
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
    hits = sum(looked) + sum(loaded)
    return {"hits": hits, "accesses": len(looked) + len(loaded)}
