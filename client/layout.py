"""The KV-cache layout: group geometry, chunking and the fingerprint that guards every read.

A chunk is only ever served to a reader whose layout decides the same bytes as the writer's, so the
layout is one frozen, validated object: every invalid value raises a ValueError naming the group, the
value and what is allowed, instead of quietly disabling a group or chunking it wrongly. Groups whose
`tokens_per_block` is not a multiple of `tokens_per_hash` cannot be keyed by the prefix hash; like vLLM,
they keep their index and are reported in `skipped_groups` rather than rejected.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .planner import Chunk, plan

# Version of the fingerprint encoding; bump it when the encoded fields change.
FINGERPRINT_FORMAT = 1

_LAYOUT_KEYS = {"groups", "blocks_per_chunk", "chunk_tokens", "tokens_per_hash", "model", "dtype",
                "world_size", "rank", "kv_layout"}
_REQUIRED_KEYS = {"groups", "tokens_per_hash", "model", "dtype"}
_GROUP_KEYS = {"tokens_per_block", "page_bytes", "layer_names", "sliding_window", "kind"}
_IGNORED_KEYS = {"source"}  # provenance notes in the reference layout files


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table (one KV-cache group)."""

    tokens_per_block: int  # tokens per block of this group; differs between groups
    page_bytes: int  # bytes of one block of one layer (the real page size, not a padded stride)
    layer_names: tuple[str, ...]  # the group's layers, in payload order ([layer][block][page])
    sliding_window: int | None = None  # window in tokens for sliding-window attention, else None
    kind: str = "full_attention"  # attention kind; "sliding_window" when a window is set

    def __post_init__(self) -> None:
        first = self.layer_names[0] if isinstance(self.layer_names, Sequence) and self.layer_names else None
        who = f"KVGroup(layer_names[0]={first!r})"
        for name in ("tokens_per_block", "page_bytes"):
            if not _is_pos_int(getattr(self, name)):
                raise ValueError(f"{who}: {name}={getattr(self, name)!r}; allowed: a positive int")
        if isinstance(self.layer_names, str) or not isinstance(self.layer_names, Sequence):
            raise ValueError(f"{who}: layer_names={self.layer_names!r}; allowed: a sequence of names")
        names = tuple(self.layer_names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"{who}: layer_names={names!r}; allowed: one or more non-empty strings")
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"{who}: layer_names repeats {dups}; allowed: unique names")
        object.__setattr__(self, "layer_names", names)
        if self.sliding_window is not None:
            if not _is_pos_int(self.sliding_window):
                raise ValueError(
                    f"{who}: sliding_window={self.sliding_window!r}; allowed: a positive int or None"
                )
            # A full-attention group with a window is a contradiction; the default kind means "unset".
            if self.kind == "full_attention":
                object.__setattr__(self, "kind", "sliding_window")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"{who}: kind={self.kind!r}; allowed: a non-empty string")
        if self.kind == "sliding_window" and self.sliding_window is None:
            raise ValueError(f"{who}: kind='sliding_window' with sliding_window=None; allowed: a window > 0")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tokens_per_block": self.tokens_per_block, "page_bytes": self.page_bytes,
                             "layer_names": list(self.layer_names), "kind": self.kind}
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        return d


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Everything that decides a chunk's bytes and key, for one rank of one model.

    Give exactly one of `blocks_per_chunk` (an int shared by all groups, vLLM's semantics, or one per
    group) and `chunk_tokens` (blocks_per_chunk[g] = chunk_tokens // tokens_per_block[g]). After
    construction `blocks_per_chunk` is always a tuple with one entry per group; passing it together with
    `chunk_tokens` is accepted only when it equals the derived tuple (so `dataclasses.replace` works).
    """

    groups: tuple[KVGroup, ...]  # KV-cache groups in the engine's order; the index is the group id
    blocks_per_chunk: tuple[int, ...] | int | None = None  # blocks per chunk, shared or per group
    chunk_tokens: int | None = None  # alternative to blocks_per_chunk: tokens per chunk in every group
    tokens_per_hash: int  # prefix-hash unit in tokens; groups' tokens_per_block must be multiples of it
    model: str  # model id; part of the namespace and the fingerprint
    dtype: str  # KV-cache dtype, e.g. "bfloat16", "fp8_ds_mla"
    world_size: int = 1  # tensor-parallel world size; each rank holds different bytes
    rank: int = 0  # this worker's rank, 0 <= rank < world_size
    kv_layout: str = "default"  # physical KV layout kind (e.g. "NHD"/"HND"); changes the page bytes

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        if not groups or not all(isinstance(gr, KVGroup) for gr in groups):
            raise ValueError(f"groups={self.groups!r}; allowed: one or more KVGroup")
        object.__setattr__(self, "groups", groups)
        self._check_scalars()
        self._check_unique_layers()
        object.__setattr__(self, "blocks_per_chunk", self._resolve_blocks_per_chunk())

    def _check_scalars(self) -> None:
        if not _is_pos_int(self.tokens_per_hash):
            raise ValueError(f"tokens_per_hash={self.tokens_per_hash!r}; allowed: a positive int")
        for name in ("model", "dtype", "kv_layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: a non-empty string")
        if not _is_pos_int(self.world_size):
            raise ValueError(f"world_size={self.world_size!r}; allowed: a positive int")
        rank_ok = isinstance(self.rank, int) and not isinstance(self.rank, bool)
        if not rank_ok or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r}; allowed: an int in [0, world_size={self.world_size})")

    def _check_unique_layers(self) -> None:
        seen: dict[str, int] = {}
        for g, group in enumerate(self.groups):
            for name in group.layer_names:
                if name in seen:
                    raise ValueError(f"group {g}: layer {name!r} is already in group {seen[name]}; "
                                     "allowed: each layer name in exactly one group")
                seen[name] = g

    def _resolve_blocks_per_chunk(self) -> tuple[int, ...]:
        if self.chunk_tokens is not None:
            derived = self._derive_from_chunk_tokens()
            if self.blocks_per_chunk is not None and self._as_tuple(self.blocks_per_chunk) != derived:
                raise ValueError(f"blocks_per_chunk={self.blocks_per_chunk!r} disagrees with chunk_tokens="
                                 f"{self.chunk_tokens} (derives {derived}); allowed: give exactly one")
            return derived
        if self.blocks_per_chunk is None:
            raise ValueError("neither blocks_per_chunk nor chunk_tokens given; allowed: exactly one of them")
        bpc = self._as_tuple(self.blocks_per_chunk)
        for g, n in enumerate(bpc):
            # a skipped group may carry 0 (what chunk_tokens derives for it); it never gets chunks
            ok = _is_pos_int(n) or (n == 0 and not self.offloadable[g] and not isinstance(n, bool))
            if not ok:
                raise ValueError(f"group {g}: blocks_per_chunk={n!r}; allowed: a positive int")
        return bpc

    def _as_tuple(self, bpc: Any) -> tuple[int, ...]:
        if isinstance(bpc, int) and not isinstance(bpc, bool):
            return (bpc,) * len(self.groups)
        if not isinstance(bpc, Sequence) or len(bpc) != len(self.groups):
            raise ValueError(f"blocks_per_chunk={bpc!r}; allowed: an int, or one int per group "
                             f"({len(self.groups)} groups)")
        return tuple(bpc)

    def _derive_from_chunk_tokens(self) -> tuple[int, ...]:
        ct = self.chunk_tokens
        if not _is_pos_int(ct):
            raise ValueError(f"chunk_tokens={ct!r}; allowed: a positive int")
        tpbs = [gr.tokens_per_block for gr, ok in zip(self.groups, self.offloadable) if ok]
        step = math.lcm(*tpbs) if tpbs else 1
        out = []
        for g, group in enumerate(self.groups):
            if ct % group.tokens_per_block == 0:
                out.append(ct // group.tokens_per_block)
            elif not self.offloadable[g]:
                out.append(0)
            else:
                raise ValueError(
                    f"group {g}: tokens_per_block={group.tokens_per_block} does not divide "
                    f"chunk_tokens={ct}; "
                    f"allowed: chunk_tokens a multiple of {step} (lcm of the offloadable groups' "
                    f"tokens_per_block {tpbs})")
        return tuple(out)

    # -- derived values -------------------------------------------------------------------------

    @property
    def offloadable(self) -> tuple[bool, ...]:
        """Per group: can its chunks be keyed by the prefix hash (tokens_per_block % tokens_per_hash == 0)."""
        return tuple(gr.tokens_per_block % self.tokens_per_hash == 0 for gr in self.groups)

    @property
    def skipped_groups(self) -> tuple[tuple[int, str], ...]:
        """(group index, reason) for every group that is not offloaded."""
        return tuple(
            (g, f"group {g}: tokens_per_block={gr.tokens_per_block} is not a multiple of "
                f"tokens_per_hash={self.tokens_per_hash}; not offloadable")
            for g, gr in enumerate(self.groups) if not self.offloadable[g]
        )

    @property
    def tokens_per_chunk(self) -> tuple[int, ...]:
        return tuple(gr.tokens_per_block * n for gr, n in zip(self.groups, self.blocks_per_chunk))

    def chunk_nbytes(self, g: int) -> int:
        """Payload bytes of one chunk of group g: [layer][block][page_bytes], contiguous."""
        group = self.groups[g]
        return len(group.layer_names) * self.blocks_per_chunk[g] * group.page_bytes

    @cached_property
    def fingerprint(self) -> str:
        """sha256 hex of everything that decides a chunk's bytes; stable across processes and runs.

        Layer names are left out on purpose: the bytes depend on the geometry (layer count, page size,
        block size), not on what the engine calls its layers; names only map tensors locally, so two
        engines naming layers differently can still share chunks.
        """
        doc = {
            "format": FINGERPRINT_FORMAT,
            "model": self.model,
            "dtype": self.dtype,
            "kv_layout": self.kv_layout,
            "tokens_per_hash": self.tokens_per_hash,
            "world_size": self.world_size,
            "rank": self.rank,
            "blocks_per_chunk": list(self.blocks_per_chunk),
            "groups": [
                {"tokens_per_block": gr.tokens_per_block, "page_bytes": gr.page_bytes,
                 "num_layers": len(gr.layer_names), "kind": gr.kind, "sliding_window": gr.sliding_window}
                for gr in self.groups
            ],
        }
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @property
    def namespace(self) -> str:
        """Default daemon namespace: readers with another layout never even look at these keys."""
        return f"{self.model}/{self.fingerprint[:16]}"

    def plan(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]],
             trim_sliding_window: bool = True) -> list[Chunk]:
        """Chunks to offload for one request; see `planner.plan`."""
        return plan(self, token_ids, block_ids, trim_sliding_window)

    # -- dict form (the reference layout files) ---------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        """Build from a dict like tests/data/layouts/*.json; "source" is ignored, unknown keys raise."""
        unknown = set(data) - _LAYOUT_KEYS - _IGNORED_KEYS
        if unknown:
            raise ValueError(f"unknown layout keys {sorted(unknown)}; allowed: {sorted(_LAYOUT_KEYS)}")
        missing = _REQUIRED_KEYS - set(data)
        if missing:
            raise ValueError(f"missing layout keys {sorted(missing)}; required: {sorted(_REQUIRED_KEYS)}")
        groups = []
        for g, gd in enumerate(data["groups"]):
            if not isinstance(gd, Mapping):
                raise ValueError(f"group {g}: {gd!r}; allowed: a dict with keys {sorted(_GROUP_KEYS)}")
            bad = set(gd) - _GROUP_KEYS
            if bad:
                raise ValueError(f"group {g}: unknown keys {sorted(bad)}; allowed: {sorted(_GROUP_KEYS)}")
            try:
                groups.append(KVGroup(**gd))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"group {g}: {exc}") from exc
        kwargs = {k: v for k, v in data.items() if k in _LAYOUT_KEYS and k != "groups"}
        bpc = kwargs.get("blocks_per_chunk")
        if isinstance(bpc, list):
            kwargs["blocks_per_chunk"] = tuple(bpc)
        return cls(groups=tuple(groups), **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Inverse of from_dict: `KVLayout.from_dict(layout.to_dict()) == layout`, JSON-serialisable."""
        d: dict[str, Any] = {"model": self.model, "dtype": self.dtype, "kv_layout": self.kv_layout,
                             "tokens_per_hash": self.tokens_per_hash, "world_size": self.world_size,
                             "rank": self.rank, "groups": [gr.to_dict() for gr in self.groups]}
        if self.chunk_tokens is not None:
            d["chunk_tokens"] = self.chunk_tokens
        elif len(set(self.blocks_per_chunk)) == 1:
            d["blocks_per_chunk"] = self.blocks_per_chunk[0]
        else:
            d["blocks_per_chunk"] = list(self.blocks_per_chunk)
        return d
