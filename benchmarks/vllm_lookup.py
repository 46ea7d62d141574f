"""Scheduler lookup time per request for 1k/8k/32k-token prompts: per-key round trips vs one batch.

    .venv/bin/python benchmarks/vllm_lookup.py [--repeat 10] [--json OUT.json]

One real ``kvtierd serve`` on a private ipc socket holds every chunk of three prompts (1k, 8k and
32k tokens) of a two-group layout at 256 tokens per chunk (Gemma-4-like: 2 x 4/32/128 keys).
For each prompt, in the same run and against the same daemon session:

* **before** (kvtier_client.vllm up to issue 11): vLLM's scheduler asks one key at a time and each
  unknown key is one leasing LOOKUP round trip, on the scheduler thread.
* **after** (``lookups.StepLookups``): step 1 answers every key "not known yet" (vLLM: RETRY) and
  sends all of them as one LOOKUP at the step's end on a background thread; step 2 answers them
  from that batch. Scheduler-thread time is both steps' calls; the batch's latency (sent until
  answered, off the scheduler thread, overlapping the model's forward pass) is shown apart.

Median over ``--repeat`` requests; round trips are counted, not assumed. Nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvtier_client import KVGroup, KVLayout, KVTierClient
from kvtier_client.index import KVTierIndex
from kvtier_client.vllm.lookups import StepLookups
from kvtierd.control import DaemonUnavailable, call
from kvtierd.protocol import Op

PROMPT_TOKENS = (1024, 8192, 32768)
LAYOUT = KVLayout(groups=[KVGroup(tokens_per_block=256, page_bytes=4096, layer_names=("s0",),
                                  kind="full_attention"),
                          KVGroup(tokens_per_block=128, page_bytes=4096, layer_names=("f0",))],
                  chunk_tokens=256, tokens_per_hash=128, model="bench-lookup", dtype="bfloat16")


def start_daemon(workdir: Path) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{workdir / 'kvtierd.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "serve", "--socket", address, "--cpu-bytes", "256MiB",
         "--page-bytes", "4KiB", "--nvme-dir", str(workdir / "nvme"), "--nvme-bytes", "64MiB",
         "--metrics-addr", "off"], stdout=open(workdir / "daemon.log", "wb"),
        stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            call(address, Op.PING, timeout_s=0.5)
            return proc, address
        except DaemonUnavailable:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((workdir / "daemon.log").read_text()) from None


def stored_keys(address: str, n_tokens: int, seed: int) -> list[bytes]:
    """Store every chunk of one random prompt; its chunk keys, in vLLM's group order."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 150_000, (n_tokens,), generator=gen).tolist()
    blocks = [list(range(n_tokens // g.tokens_per_block)) for g in LAYOUT.groups]
    kv = {g.layer_names[0]: torch.randint(0, 256, (len(b), 4096), dtype=torch.uint8, generator=gen)
          for g, b in zip(LAYOUT.groups, blocks)}
    chunks = LAYOUT.plan(tokens, blocks)
    with KVTierClient.connect(address, layout=LAYOUT, kv_caches=kv) as client:
        assert all(client.store(chunks).result(timeout=120))
    return [c.key for c in chunks]


def before(index: KVTierIndex, keys: list[bytes]) -> dict:
    t0 = time.perf_counter()
    tiers = [index.lookup([k], lease=True)[0] for k in keys]
    elapsed = time.perf_counter() - t0
    assert all(tiers)
    return {"scheduler_s": elapsed, "round_trips": len(keys)}


def after(lookups: StepLookups, keys: list[bytes]) -> dict:
    sent = lookups.batches_sent
    t0 = time.perf_counter()
    assert all(lookups.tier(k) is None for k in keys)  # step 1: RETRY for every key
    lookups.end_step()
    step1 = time.perf_counter() - t0
    assert lookups.wait_idle(60)
    answered = time.perf_counter() - t0
    t1 = time.perf_counter()
    tiers = [lookups.tier(k) for k in keys]  # step 2: answered from the batch
    step2 = time.perf_counter() - t1
    assert all(tiers)
    lookups.end_step()
    lookups.end_step()  # its answers expire, so the next repetition asks the daemon again
    return {"scheduler_s": step1 + step2, "batch_latency_s": answered - step1,
            "round_trips": lookups.batches_sent - sent}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-lookup-") as tmp:
        proc, address = start_daemon(Path(tmp))
        index = KVTierIndex(address, namespace=LAYOUT.namespace, rank=0,
                            fingerprint=LAYOUT.fingerprint, timeout_s=10)
        lookups = StepLookups(lambda keys: index.lookup(keys, lease=True))
        rows = []
        try:
            for seed, n in enumerate(PROMPT_TOKENS):
                keys = stored_keys(address, n, seed)
                runs = [(before(index, keys), after(lookups, keys)) for _ in range(args.repeat)]
                med = {side: {k: statistics.median(r[i][k] for r in runs) for k in runs[0][i]}
                       for i, side in enumerate(("before", "after"))}
                rows.append({"prompt_tokens": n, "keys": len(keys), **med})
        finally:
            lookups.close()
            index.close()
            proc.terminate()
            proc.wait(timeout=60)
    print(f"{'prompt':>7} {'keys':>5} | {'before: round trips':>19} {'scheduler ms':>12} | "
          f"{'after: round trips':>18} {'scheduler ms':>12} {'batch ms':>8} | speed-up")
    for r in rows:
        b, a = r["before"], r["after"]
        print(f"{r['prompt_tokens']:>7} {r['keys']:>5} | {b['round_trips']:>19.0f} "
              f"{b['scheduler_s'] * 1e3:>12.2f} | {a['round_trips']:>18.0f} "
              f"{a['scheduler_s'] * 1e3:>12.2f} {a['batch_latency_s'] * 1e3:>8.2f} | "
              f"{b['scheduler_s'] / a['scheduler_s']:>7.1f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
