"""Peer stores that ``benchmarks/vs_peers.py`` measures kvtierd against, one module per peer.

The contract a peer module implements (so a new peer is one file dropped in this folder):

    def run(sizes: list[int], rounds: int, workdir: Path) -> list[dict]

It installs what it needs into its own environment (never the project's), starts the peer,
measures store and load of chunks of each size in ``sizes`` (best of ``rounds``), stops the peer,
leaves nothing behind outside ``workdir`` and returns one row per size:
``{"peer", "path", "chunk_bytes", "store_gbps", "load_gbps"}`` (more keys are kept as they are).
``path`` is either ``PATH_KV`` (paged KV tensors through the engine-side client, the bytes gathered
from and scattered to random blocks) or ``PATH_RAW`` (contiguous buffers of ``chunk_bytes``); it
tells vs_peers which kvtierd row the peer is set against. A peer that cannot run raises
``PeerUnavailable`` with the reason, and vs_peers reports it instead of a row.

``KVGeometry`` is the KV-tensor case both sides of a ``PATH_KV`` comparison build from the same
seed, so they move the same bytes between the same blocks. It imports torch only when it makes
tensors: peer modules import this package in the project's environment without loading their peer.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

PATH_KV = "kv tensors"
PATH_RAW = "raw bytes"
ROW_KEYS = ("peer", "path", "chunk_bytes", "store_gbps", "load_gbps")

LAYERS = 32
TOKENS_PER_BLOCK = 16
HEAD_SIZE = 128
DTYPE = "bfloat16"
DTYPE_BYTES = 2
#: bytes of one head of one block of all layers, K and V: the step between chunk sizes
HEAD_CHUNK_BYTES = LAYERS * 2 * TOKENS_PER_BLOCK * HEAD_SIZE * DTYPE_BYTES
#: batch moved per store or load request, as ``benchmarks/client_path.py`` does
BATCH_BYTES = 32 * 1024**2
QUICK_BATCH_BYTES = 2 * 1024**2
POISON = 0xA5


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (install refused, server did not start); the message says why."""


@dataclass(frozen=True)
class KVGeometry:
    """A Llama-like paged KV cache: per layer ``[blocks, 2, tokens_per_block, heads, head_size]``
    bf16 (vLLM's block-first, FlashInfer-style layout, which both kvtierd and LMCache accept), one
    block per chunk. A page (one block of one layer, K and V) is ``2 * 16 * heads * 128 * 2``
    bytes: 8 KiB for a 256 KiB chunk, 64 KiB for a 2 MiB chunk. Blocks ``store_blocks`` hold
    random bytes and are stored; a load writes into ``load_blocks`` (poisoned first), which a
    check then compares with ``store_blocks``. Block 0 is never used: LMCache reads it as "no
    block" (its ``null_block_id``)."""

    chunk_bytes: int
    batch_bytes: int = BATCH_BYTES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % HEAD_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={self.chunk_bytes}; allowed: a positive multiple of "
                             f"{HEAD_CHUNK_BYTES} (one 128-wide head of {LAYERS} layers, "
                             f"{TOKENS_PER_BLOCK} tokens, K and V, bf16)")

    @property
    def heads(self) -> int:
        return self.chunk_bytes // HEAD_CHUNK_BYTES

    @property
    def page_bytes(self) -> int:
        return self.chunk_bytes // LAYERS

    @property
    def chunks(self) -> int:
        """Chunks per request (one batch)."""
        return max(1, self.batch_bytes // self.chunk_bytes)

    @property
    def num_blocks(self) -> int:
        return 2 * self.chunks + 1  # store blocks, load blocks, block 0

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS))

    def block_ids(self) -> tuple[list[int], list[int]]:
        """(store blocks, load blocks): a random permutation of 1..num_blocks-1, as a real block
        table is."""
        import numpy as np

        perm = [int(b) + 1 for b in np.random.default_rng(self.seed).permutation(
            self.num_blocks - 1)]
        return perm[:self.chunks], perm[self.chunks:2 * self.chunks]

    def kv_caches(self) -> dict[str, Any]:
        """The per-layer tensors, filled with random bytes (the same bytes for every caller)."""
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.num_blocks, 2, TOKENS_PER_BLOCK, self.heads, HEAD_SIZE)
        caches = {}
        for name in self.layer_names:
            t = torch.empty(shape, dtype=torch.bfloat16)
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
            caches[name] = t
        return caches


def poison(kv_caches: dict[str, Any], blocks: list[int]) -> None:
    """Overwrite ``blocks`` of every layer so that a load that writes nothing is seen."""
    import torch

    for t in kv_caches.values():
        t.view(torch.uint8)[blocks] = POISON


def loaded_correctly(kv_caches: dict[str, Any], src: list[int], dst: list[int]) -> bool:
    """Whether every layer's ``dst`` blocks now hold exactly the bytes of its ``src`` blocks."""
    import torch

    return all(torch.equal(t[s].view(torch.uint8), t[d].view(torch.uint8))
               for t in kv_caches.values() for s, d in zip(src, dst))


def discover() -> dict[str, ModuleType]:
    """Every peer module in this package (a module with a ``run`` function), by its name."""
    peers = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except ImportError as exc:  # one broken peer must not stop the others
            print(f"peers: {info.name} cannot be imported, left out: {exc}", file=sys.stderr)
            continue
        if callable(getattr(module, "run", None)):
            peers[info.name] = module
    return peers


def checked_rows(peer: str, rows: list[dict]) -> list[dict]:
    """A peer's rows, refused with the peer's name when a row lacks a key of the contract."""
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"peer {peer!r} returned a row without {missing}: {row!r}; "
                             f"allowed: rows with {list(ROW_KEYS)}")
    return rows
