"""``kvtierd demo``: a simulated engine worker storing and reloading KV caches through a real daemon.

It uses two layouts whose groups have different tokens per block — the case that single-block-size
offloading chunked wrongly without crashing — scaled down from real geometries (layer counts and
page sizes smaller; group count, tokens per block, windows and hash unit as in the models):

* Gemma-4-31B-like: five sliding-window groups of 16 tokens/block (window 1024) and one full group
  of 32 tokens/block;
* DeepSeek-V4-Flash-like: groups of 256, 64, 64 (sliding, window 128), 4 and 8 tokens per block,
  hash unit 4.

For each prompt it plans per-group chunks, stores them, looks them up (as vLLM's scheduler does),
poisons the KV cache, reloads and compares byte for byte. Then a second reader looks the same prompts
up with the layout that chunks every group by one model-wide block size (the mistake of vLLM PR
#48878): it must find nothing, because a chunk is never served to a layout other than its writer's.
Last it prints the tables and the daemon's own stats; it fails if a byte differs or that reader hits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from kvtierd.cli import _BOOL_FLAGS, _CONFIG_FLAGS, _load, format_stats
from kvtierd.control import DaemonUnavailable, call
from kvtierd.protocol import Op
from kvtierd.sizes import format_size

GEMMA4_LIKE = {
    "model": "gemma-4-31b-demo", "dtype": "bfloat16", "tokens_per_hash": 16, "blocks_per_chunk": 8,
    "groups": [
        *({"tokens_per_block": 16, "page_bytes": 16384, "kind": "sliding_window",
           "sliding_window": 1024, "layer_names": [f"sliding.{2 * g}", f"sliding.{2 * g + 1}"]}
          for g in range(5)),
        {"tokens_per_block": 32, "page_bytes": 16384, "kind": "full_attention",
         "layer_names": ["full.0", "full.1"]},
    ],
}
DEEPSEEK_V4_FLASH_LIKE = {
    "model": "deepseek-v4-flash-demo", "dtype": "fp8_ds_mla", "tokens_per_hash": 4,
    "blocks_per_chunk": 2,
    "groups": [
        {"tokens_per_block": 256, "page_bytes": 9344, "kind": "mla",
         "layer_names": ["mla.0", "mla.1"]},
        {"tokens_per_block": 64, "page_bytes": 9344, "kind": "sliding_window", "sliding_window": 128,
         "layer_names": ["swa_a.0", "swa_a.1"]},
        {"tokens_per_block": 64, "page_bytes": 9344, "kind": "sliding_window", "sliding_window": 128,
         "layer_names": ["swa_b.0", "swa_b.1"]},
        # compressor states: vLLM's SlidingWindowMLASpec, window = coff * compress_ratio
        {"tokens_per_block": 4, "page_bytes": 9344, "kind": "sliding_window", "sliding_window": 8,
         "layer_names": ["c4_state.0", "c4_state.1"]},
        {"tokens_per_block": 8, "page_bytes": 9344, "kind": "sliding_window", "sliding_window": 128,
         "layer_names": ["c128_state.0", "c128_state.1"]},
    ],
}


@dataclass
class GroupRow:
    layout: str
    group: int
    tokens_per_block: int
    blocks_per_chunk: int
    tokens_per_chunk: int
    chunks: int = 0
    nbytes: int = 0
    found: int = 0  # LOOKUP hits right after the store
    hits: int = 0  # chunks the load filled


@dataclass
class WrongLayoutRow:
    """What a reader with one block size for every group found of a layout's stored prompts."""
    layout: str
    tokens_per_block: int
    chunks: int
    found: int


def _kv_caches(layout, tokens: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    caches = {}
    for group in layout.groups:
        blocks = -(-tokens // group.tokens_per_block)
        for name, page in zip(group.layer_names, group.layer_page_bytes):
            caches[name] = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=gen)
    return caches


def one_block_size(spec: dict) -> dict:
    """``spec`` with every group at the first group's tokens per block: the single model-wide
    ``block_size`` that offloading code assumed before vLLM PR #48878."""
    tokens_per_block = spec["groups"][0]["tokens_per_block"]
    return {**spec, "groups": [{**g, "tokens_per_block": tokens_per_block} for g in spec["groups"]]}


def _block_ids(layout, tokens: int) -> list[list[int]]:
    return [list(range(-(-tokens // g.tokens_per_block))) for g in layout.groups]


def run_wrong_layout(address: str, spec: dict, prompts: list[list[int]], tokens: int,
                     gen: torch.Generator) -> WrongLayoutRow:
    """Look ``prompts`` up as a reader whose layout chunks every group by one block size."""
    from kvtier_client import KVLayout, KVTierClient

    layout = KVLayout.from_dict(one_block_size(spec))
    block_ids = _block_ids(layout, tokens)
    row = WrongLayoutRow(layout.model, layout.groups[0].tokens_per_block, 0, 0)
    with KVTierClient.connect(address, layout=layout,
                              kv_caches=_kv_caches(layout, tokens, gen)) as client:
        for prompt in prompts:
            chunks = layout.plan(prompt, block_ids)
            row.chunks += len(chunks)
            row.found += sum(client.lookup(chunks))
    return row


def run_layout(address: str, spec: dict, args: argparse.Namespace, seed: int
               ) -> tuple[list[GroupRow], float, float, int, WrongLayoutRow]:
    from kvtier_client import KVLayout, KVTierClient

    layout = KVLayout.from_dict(spec)
    gen = torch.Generator().manual_seed(seed)
    kv = _kv_caches(layout, args.tokens, gen)
    rows = [GroupRow(layout.model, g, grp.tokens_per_block, layout.blocks_per_chunk[g],
                     layout.tokens_per_chunk[g]) for g, grp in enumerate(layout.groups)]
    store_s = load_s = 0.0
    mismatches = 0
    block_ids = _block_ids(layout, args.tokens)
    prompts = []
    with KVTierClient.connect(address, layout=layout, kv_caches=kv) as client:
        for _ in range(args.requests):
            for t in kv.values():
                t.random_(0, 256, generator=gen)
            tokens = torch.randint(0, 200_000, (args.tokens,), generator=gen).tolist()
            prompts.append(tokens)
            chunks = layout.plan(tokens, block_ids)
            saved = {n: t.clone() for n, t in kv.items()}
            t0 = time.perf_counter()
            stored = client.store(chunks).result(timeout=60)
            t1 = time.perf_counter()
            found = client.lookup(chunks)
            for t in kv.values():
                t.fill_(0xAB)  # poison: a load that did nothing cannot pass
            t2 = time.perf_counter()
            loaded = client.load(chunks).result(timeout=60)
            t3 = time.perf_counter()
            store_s += t1 - t0
            load_s += t3 - t2
            for chunk, ok_store, ok_found, ok_load in zip(chunks, stored, found, loaded):
                row = rows[chunk.group]
                row.found += ok_found
                row.chunks += ok_store
                row.nbytes += chunk.nbytes if ok_store else 0
                row.hits += ok_load
                for name in layout.groups[chunk.group].layer_names:
                    ids = torch.tensor(chunk.block_ids)
                    if ok_load and not torch.equal(kv[name][ids], saved[name][ids]):
                        mismatches += 1
    wrong = run_wrong_layout(address, spec, prompts, args.tokens, gen)
    return rows, store_s, load_s, mismatches, wrong


def _print_table(rows: list[GroupRow], timing: dict[str, tuple[float, float, int]],
                 wrong: list[WrongLayoutRow]) -> None:
    print(f"\n{'layout':<24}{'group':>6}{'tok/blk':>8}{'blk/chunk':>10}{'tok/chunk':>10}"
          f"{'chunks':>8}{'bytes':>12}{'found':>6}{'hits':>6}")
    for r in rows:
        print(f"{r.layout:<24}{r.group:>6}{r.tokens_per_block:>8}{r.blocks_per_chunk:>10}"
              f"{r.tokens_per_chunk:>10}{r.chunks:>8}{format_size(r.nbytes):>12}{r.found:>6}"
              f"{r.hits:>6}")
    print(f"\n{'layout':<24}{'stored':>12}{'store GB/s':>12}{'load GB/s':>12}{'verified':>12}")
    for name, (store_s, load_s, mismatches) in timing.items():
        nbytes = sum(r.nbytes for r in rows if r.layout == name)
        verdict = "byte-exact" if mismatches == 0 else f"{mismatches} BAD"
        print(f"{name:<24}{format_size(nbytes):>12}{nbytes / store_s / 1e9:>12.2f}"
              f"{nbytes / load_s / 1e9:>12.2f}{verdict:>12}")
    print("\nthe same prompts looked up by a reader that chunks every group by one block size "
          "(vLLM PR #48878's mistake):")
    print(f"{'layout':<24}{'tok/blk':>8}{'chunks':>8}{'found':>6}  verdict")
    for w in wrong:
        verdict = "miss, never wrong bytes" if w.found == 0 else f"{w.found} WRONG HITS"
        print(f"{w.layout:<24}{w.tokens_per_block:>8}{w.chunks:>8}{w.found:>6}  {verdict}")


def _start_daemon(args: argparse.Namespace) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvtierd", "serve"]
    if args.config:
        argv += ["--config", args.config]
    for flag, key, _ in _CONFIG_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            argv += [flag, str(value)]
    for flag, key, _ in _BOOL_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            argv.append(flag if value else "--no-" + flag[2:])
    return subprocess.Popen(argv)


def _wait_ready(address: str, proc: subprocess.Popen | None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kvtierd serve exited with {proc.returncode}")
        try:
            call(address, Op.PING, timeout_s=0.5)
            return
        except DaemonUnavailable:
            continue
    raise RuntimeError(f"kvtierd did not answer at {address} within {timeout_s:g} s")


def run_demo(args: argparse.Namespace) -> int:
    cfg = _load(args)
    proc = None
    try:
        call(cfg.socket, Op.PING, timeout_s=0.5)
        print(f"using the kvtierd already serving at {cfg.socket}")
    except DaemonUnavailable:
        print(f"starting kvtierd at {cfg.socket}")
        proc = _start_daemon(args)
    try:
        _wait_ready(cfg.socket, proc)
        rows: list[GroupRow] = []
        timing = {}
        wrong: list[WrongLayoutRow] = []
        for seed, spec in enumerate((GEMMA4_LIKE, DEEPSEEK_V4_FLASH_LIKE)):
            layout_rows, store_s, load_s, bad, wrong_row = run_layout(cfg.socket, spec, args, seed)
            rows += layout_rows
            timing[spec["model"]] = (store_s, load_s, bad)
            wrong.append(wrong_row)
        _print_table(rows, timing, wrong)
        stats = call(cfg.socket, Op.STATS, token=cfg.admin_token or cfg.auth_token)["stats"]
        print("\n" + format_stats(stats))
        print(f"\nPrometheus metrics: {stats['daemon']['metrics'] or 'off'}   "
              f"table again: kvtierd stats --socket {cfg.socket}")
        failed = any(bad for _, _, bad in timing.values()) or any(w.found for w in wrong)
        if proc is not None and args.keep_serving and not failed:
            print("kvtierd keeps serving; Ctrl-C stops it")
            proc.wait()
        return 1 if failed else 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
