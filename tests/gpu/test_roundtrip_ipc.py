"""GPU KV cache → daemon (CUDA IPC staging, DMA into the pinned arena) → other block ids, byte for
byte; a client killed mid-transfer leaves the daemon healthy and its IPC handle closed."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers.kv import LAYOUTS_DIR, load_layout, random_tokens
from kvtier_client import KVTierClient

POISON = 0xAB


def cuda_kv(layout, blocks, gen):
    kv = {}
    for g, group in enumerate(layout.groups):
        for name, page in zip(group.layer_names, group.layer_page_bytes):
            host = torch.randint(0, 256, (blocks, 2, page), dtype=torch.uint8, generator=gen)
            kv[name] = host.cuda()[:, 0]  # K of packed K/V: stride(0) = 2 pages
    return kv


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_roundtrip_to_other_blocks_is_byte_exact(daemon_factory):
    daemon = daemon_factory(cpu_bytes="512MiB")
    gen = torch.Generator().manual_seed(5)
    # one group with per-layer pages (MLA latents + indexer caches)
    layout = load_layout(LAYOUTS_DIR / "deepseek-v3.2.json", page_bytes=8192, layers_per_group=3)
    blocks = 256
    kv = cuda_kv(layout, blocks, gen)
    tokens = random_tokens(gen, 2048)
    table = [list(range(-(-2048 // gr.tokens_per_block))) for gr in layout.groups]
    table = [[b % (blocks // 2) for b in ids] for ids in table]
    chunks = layout.plan(tokens, table, trim_sliding_window=False)
    assert chunks
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert daemon.stats()["cuda"]["open_handles"] == 1
        assert all(client.store(chunks).result(timeout=60))
        moved = [dataclasses.replace(c, block_ids=tuple(b + blocks // 2 for b in c.block_ids))
                 for c in chunks]
        for t in kv.values():
            t[blocks // 2:].fill_(POISON)
        assert all(client.load(moved).result(timeout=60))
        for c, m in zip(chunks, moved):
            for name in layout.groups[c.group].layer_names:
                for a, b in zip(c.block_ids, m.block_ids):
                    assert torch.equal(kv[name][a], kv[name][b]), (name, a, b)
    assert wait_for(lambda: daemon.stats()["cuda"]["open_handles"] == 0)
    # Wait for pinning to end, whatever its outcome: a "failed" or "unavailable" is known at once
    # and its reason is what the device run must report.
    assert wait_for(lambda: daemon.stats()["cuda"]["pinning"]["state"] != "pinning", 120)
    pinning = daemon.stats()["cuda"]["pinning"]
    print(f"arena pinning: {pinning}")
    assert pinning["state"] == "ready", (
        f"arena pinning ended {pinning['state']!r}: {pinning['reason']}")
    daemon.check()


KILLED_CLIENT = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from helpers.kv import simple_layout, random_tokens
from kvtier_client import KVTierClient
layout = simple_layout(page_bytes=1 << 20, layers=4, blocks_per_chunk=4)
kv = {n: torch.randint(0, 256, (64, 1 << 20), dtype=torch.uint8).cuda() for n in layout.groups[0].layer_names}
gen = torch.Generator().manual_seed(1)
client = KVTierClient.connect(sys.argv[1], layout=layout, kv_caches=kv, staging_bytes=256 << 20)
print("ready", flush=True)
while True:
    chunks = layout.plan(random_tokens(gen, 1024), [list(range(64))], trim_sliding_window=False)
    client.store(chunks).result(timeout=60)
    client.load(chunks).result(timeout=60)
"""


def test_client_killed_mid_transfer_leaves_the_daemon_healthy(daemon_factory, tmp_path):
    daemon = daemon_factory(cpu_bytes="1GiB")
    script = tmp_path / "client.py"
    script.write_text(KILLED_CLIENT)
    helpers = str(Path(__file__).parent.parent)
    proc = subprocess.Popen([sys.executable, str(script), daemon.address, helpers],
                            stdout=subprocess.PIPE, env=os.environ.copy())
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert wait_for(lambda: daemon.stats()["cuda"]["opened_total"] >= 1)
        time.sleep(1.5)  # several store/load rounds in flight
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_for(lambda: daemon.stats()["cuda"]["open_handles"] == 0, 60), daemon.stats()
    assert daemon.stats()["sessions"] == 0
    daemon.check()
    # and it still serves a GPU client
    gen = torch.Generator().manual_seed(9)
    layout = load_layout(LAYOUTS_DIR / "llama-3.1-8b.json", page_bytes=4096, layers_per_group=2)
    kv = cuda_kv(layout, 64, gen)
    tokens = random_tokens(gen, 512)
    table = [list(range(-(-512 // gr.tokens_per_block))) for gr in layout.groups]
    table = [[b % 64 for b in ids] for ids in table]
    chunks = layout.plan(tokens, table, trim_sliding_window=False)
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert all(client.store(chunks).result(timeout=60))
        assert all(client.lookup(chunks))
    assert "Traceback" not in daemon.log()
