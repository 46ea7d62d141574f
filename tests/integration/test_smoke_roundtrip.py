"""The simplest end-to-end path, kept separate so that a broken daemon fails one obvious test."""

import torch

from kvtier_client import KVGroup, KVLayout, KVTierClient


def test_store_poison_load_is_byte_exact(daemon):
    layout = KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=8192, layer_names=("l0", "l2")),
                KVGroup(tokens_per_block=64, page_bytes=8192, layer_names=("l1", "l3"),
                        sliding_window=512)],
        blocks_per_chunk=4, tokens_per_hash=16, model="tiny", dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    kv = {n: torch.randint(0, 256, (64, 8192), dtype=torch.uint8, generator=gen)
          for n in ("l0", "l1", "l2", "l3")}
    tokens = torch.randint(0, 50000, (1000,), generator=gen).tolist()
    chunks = layout.plan(tokens, [list(range(63)), list(range(16))])
    expected = {(c.group, n, b): kv[n][b].clone() for c in chunks
                for n in layout.groups[c.group].layer_names for b in c.block_ids}
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert all(client.store(chunks).result(timeout=30))
        assert all(client.lookup(chunks))
        for t in kv.values():
            t.fill_(0xAB)
        assert all(client.load(chunks).result(timeout=30))
    for (g, n, b), page in expected.items():
        assert torch.equal(kv[n][b], page), (g, n, b)
    assert daemon.cpu()["chunks"] == len(chunks)
