"""The KV-cache layout: group geometry, chunking and the fingerprint that guards every read.

A chunk is only ever served to a reader whose layout decides the same bytes as the writer's, so the
layout is one frozen, validated object: every invalid value raises a ValueError naming the group, the
value and what is allowed, instead of quietly disabling a group or chunking it wrongly. Groups whose
`tokens_per_block` is not a multiple of `tokens_per_hash` cannot be keyed by the prefix hash; like vLLM,
they keep their index and are reported in `skipped_groups` rather than rejected.

What a group caches is a closed set of kinds with vLLM's names (`KIND_NAMES`): the planner keeps a
different part of a request for each (sliding and chunked-local windows, the single last state of a
recurrent group), so a free-text kind would silently plan the wrong chunks. A group's page size may
differ per layer (vLLM groups layers of one type and block size even when their pages differ, e.g.
DeepSeek-V3.2's MLA latents and lightning-indexer caches).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .planner import Chunk, plan, window_chunks

# Version of the fingerprint encoding; bump it when the encoded fields change.
FINGERPRINT_FORMAT = 1

#: Every group kind kvtierd can plan, with vLLM's names. `mamba` is every recurrent-state kind
#: (Mamba, Mamba2, GDN / linear attention): its block is the state at the block's end.
KIND_NAMES = ("full_attention", "sliding_window", "chunked_local_attention", "mla", "mla_indexer",
              "mamba")
#: Kinds whose `sliding_window` is required: the window in tokens, or the attention chunk size.
WINDOWED_KINDS = ("sliding_window", "chunked_local_attention")
#: Kinds whose blocks are recurrent states: only the last complete chunk is usable.
STATE_KINDS = ("mamba",)
# Kinds vLLM has that can never be keyed by a decoder prefix, with the reason the error gives.
_REFUSED_KINDS = {
    "cross_attention": "its KV depends on the encoder input, not on the decoder prefix, so prefix "
                       "keys would alias different inputs",
    "encoder_only": "encoder-only layers keep no KV cache between steps",
}

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
    # bytes of one block of one layer (the real page size, not a padded stride): one int for every
    # layer, or one int per entry of layer_names when the group's layers have different page sizes
    page_bytes: int | tuple[int, ...]
    layer_names: tuple[str, ...]  # the group's layers, in payload order ([layer][block][page])
    # kind sliding_window: the window in tokens; chunked_local_attention: the attention chunk size
    # (vLLM's attention_chunk_size); None for every other kind
    sliding_window: int | None = None
    kind: str = "full_attention"  # one of KIND_NAMES; "sliding_window" when only a window is set

    def __post_init__(self) -> None:
        first = self.layer_names[0] if isinstance(self.layer_names, Sequence) and self.layer_names else None
        who = f"KVGroup(layer_names[0]={first!r})"
        if not _is_pos_int(self.tokens_per_block):
            raise ValueError(f"{who}: tokens_per_block={self.tokens_per_block!r}; "
                             "allowed: a positive int")
        if isinstance(self.layer_names, str) or not isinstance(self.layer_names, Sequence):
            raise ValueError(f"{who}: layer_names={self.layer_names!r}; allowed: a sequence of names")
        names = tuple(self.layer_names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"{who}: layer_names={names!r}; allowed: one or more non-empty strings")
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"{who}: layer_names repeats {dups}; allowed: unique names")
        object.__setattr__(self, "layer_names", names)
        object.__setattr__(self, "page_bytes", self._checked_page_bytes(who, len(names)))
        self._check_kind(who)

    def _checked_page_bytes(self, who: str, num_layers: int) -> int | tuple[int, ...]:
        pb = self.page_bytes
        if isinstance(pb, (tuple, list)):  # not any Sequence: bytes would pass as small ints
            pages = tuple(pb)
            if len(pages) == num_layers and all(_is_pos_int(p) for p in pages):
                return pages  # kept as given, even when all equal: to_dict gives back what came in
            raise ValueError(f"{who}: page_bytes={list(pages)!r}; allowed: a positive int, or one "
                             f"positive int per layer ({num_layers} layers)")
        if not _is_pos_int(pb):
            raise ValueError(f"{who}: page_bytes={pb!r}; allowed: a positive int, or one positive "
                             f"int per layer ({num_layers} layers)")
        return pb

    def _check_kind(self, who: str) -> None:
        if self.sliding_window is not None:
            if not _is_pos_int(self.sliding_window):
                raise ValueError(
                    f"{who}: sliding_window={self.sliding_window!r}; allowed: a positive int or None"
                )
            # A full-attention group with a window is a contradiction; the default kind means "unset".
            if self.kind == "full_attention":
                object.__setattr__(self, "kind", "sliding_window")
        if isinstance(self.kind, str) and self.kind in _REFUSED_KINDS:
            raise ValueError(f"{who}: kind={self.kind!r} cannot be offloaded: "
                             f"{_REFUSED_KINDS[self.kind]}; allowed: one of {KIND_NAMES}")
        if not isinstance(self.kind, str) or self.kind not in KIND_NAMES:
            raise ValueError(f"{who}: kind={self.kind!r}; allowed: one of {KIND_NAMES}")
        if self.kind in WINDOWED_KINDS and self.sliding_window is None:
            what = "the window" if self.kind == "sliding_window" else "the attention chunk size"
            raise ValueError(f"{who}: kind={self.kind!r} with sliding_window=None; "
                             f"allowed: {what} in tokens, a window > 0")
        if self.kind not in WINDOWED_KINDS and self.sliding_window is not None:
            raise ValueError(f"{who}: sliding_window={self.sliding_window} with "
                             f"kind={self.kind!r}; allowed: a window only for kinds "
                             f"{WINDOWED_KINDS}")

    @property
    def layer_page_bytes(self) -> tuple[int, ...]:
        """The page size of every layer, in layer order (one entry per layer, always)."""
        if isinstance(self.page_bytes, tuple):
            return self.page_bytes
        return (self.page_bytes,) * len(self.layer_names)

    @property
    def group_page_bytes(self) -> int:
        """Bytes of one block across the group's layers (the sum of the layers' pages)."""
        return sum(self.layer_page_bytes)

    @property
    def is_state(self) -> bool:
        """Whether the group's blocks are recurrent states (only the last one is usable)."""
        return self.kind in STATE_KINDS

    def _fingerprint_pages(self) -> int | list[int]:
        """Canonical page sizes: equal per-layer sizes decide the same bytes as one int, so they
        encode as that int (and int fingerprints are unchanged from format 1)."""
        pages = self.layer_page_bytes
        return pages[0] if len(set(pages)) == 1 else list(pages)

    def to_dict(self) -> dict[str, Any]:
        pages = list(self.page_bytes) if isinstance(self.page_bytes, tuple) else self.page_bytes
        d: dict[str, Any] = {"tokens_per_block": self.tokens_per_block, "page_bytes": pages,
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
        self._check_state_groups()
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

    def _check_state_groups(self) -> None:
        """Refuse a skipped state group beside offloaded groups: a hybrid model resumes from a
        prefix only with both its attention KV and its recurrent state, so hits on the attention
        groups alone could never be used."""
        offloaded = [g for g, ok in enumerate(self.offloadable) if ok]
        for g, group in enumerate(self.groups):
            if group.is_state and not self.offloadable[g] and offloaded:
                raise ValueError(
                    f"group {g}: kind={group.kind!r} with "
                    f"tokens_per_block={group.tokens_per_block} is not a multiple of "
                    f"tokens_per_hash={self.tokens_per_hash}, so its state cannot be offloaded "
                    f"while groups {offloaded} are, and their prefix hits would be unusable; "
                    "allowed: tokens_per_hash dividing every state group's tokens_per_block")

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

    def window_chunks(self, g: int) -> int | None:
        """How many trailing chunks of group g a load can use (None: all); vLLM's
        `sliding_window_size_in_chunks` for the same group, which an adapter can check against."""
        return window_chunks(self.groups[g], self.tokens_per_chunk[g])

    def chunk_nbytes(self, g: int) -> int:
        """Payload bytes of one chunk of group g: [layer][block][page], contiguous, each layer with
        its own page size."""
        return self.blocks_per_chunk[g] * self.groups[g].group_page_bytes

    @cached_property
    def fingerprint(self) -> str:
        """sha256 hex of everything that decides a chunk's bytes; stable across processes and runs.

        Per-layer page sizes are encoded canonically (one int when they are all equal, the list
        otherwise), so `page_bytes=(x, x)` and `page_bytes=x` share chunks: they decide the same
        bytes.
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
                {"tokens_per_block": gr.tokens_per_block, "page_bytes": gr._fingerprint_pages(),
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
