"""Loading idle READY chunks straight into ``ChunkIndex``'s columns (recovery after a restart):
no ``ChunkEntry`` per chunk, and for a batch of single-run rows, C-level extends of every column.
``ChunkIndex`` mixes it in; the columns, key spaces and interners it fills are ChunkIndex's
(``kvtierd.tiers.compact_index`` says what each holds)."""

from __future__ import annotations

import collections
from array import array

from kvtierd.tiers.allocator import Run
from kvtierd.tiers.chunk import ChunkEntry, ChunkState
from kvtierd.tiers.index_parts import CHECKSUM_BYTES, MULTI, SUMMED, USED, VERIFIED


class BulkLoad:
    """The loading half of ``ChunkIndex`` (its ``add``, ``_new_slot`` and ``_new_space`` do
    the per-chunk work)."""

    def add_compact(self, space: tuple, key: bytes, fingerprint: str, nbytes: int,
                    checksum: bytes, runs: list[Run], *, verified: bool) -> int:
        """Index an idle READY chunk straight into columns (recovery: no object per chunk)."""
        if len(checksum) != CHECKSUM_BYTES:
            entry = ChunkEntry(ikey=(space, key), fingerprint=fingerprint, nbytes=nbytes,
                               runs=runs, owner=0, state=ChunkState.READY, checksum=checksum,
                               verified=verified)
            self.add(entry)
            return entry.slot
        slot = self._new_slot(space, key, fingerprint, nbytes, runs)
        self._flags[slot] = (USED | SUMMED | (VERIFIED if verified else 0)
                             | (MULTI if len(runs) != 1 else 0))
        i = slot * CHECKSUM_BYTES
        self._sum[i:i + CHECKSUM_BYTES] = checksum
        return slot

    def extend_compact(self, space: tuple, keys: tuple[bytes, ...], fingerprints: tuple[str, ...],
                       sizes: tuple[int, ...] | array, starts: array, checksums: bytes, *,
                       verified: bool) -> int:
        """``add_compact`` for many single-run chunks of one key space at once (recovery): new
        slots at the end, in order; returns the first. All or nothing."""
        found = self._spaces.get(space)
        if found is None:
            found = self._new_space(space)
        first, n = len(self._keys), len(keys)
        before = len(found.keys)
        found.keys.update(zip(keys, range(first, first + n)))
        if len(found.keys) != before + n:  # a key twice, or one indexed already: undo
            for key in keys:
                if found.keys.get(key, -1) >= first:
                    del found.keys[key]
            raise KeyError(f"a key of {space!r} is indexed twice")
        self._space.extend(array("I", [found.id]) * n)
        self._extend_columns(keys, fingerprints, sizes, starts, checksums, verified)
        return first

    def _extend_columns(self, keys: tuple[bytes, ...], fingerprints: tuple[str, ...],
                        sizes: tuple[int, ...] | array, starts: array, checksums: bytes,
                        verified: bool) -> None:
        """Every column but the space, for new single-run slots at the end (C-level extends)."""
        n = len(keys)
        if fingerprints.count(fingerprints[0]) == n:  # the common case: identity compares only
            self._fp.extend(array("I", [self._fps.take_many(fingerprints[0], n)]) * n)
        else:
            fp_ids = {fp: self._fps.take_many(fp, count)
                      for fp, count in collections.Counter(fingerprints).items()}
            self._fp.extend(array("I", map(fp_ids.__getitem__, fingerprints)))
        self._nbytes.extend(sizes)
        self._start.extend(starts)
        self._keys.extend(keys)
        self._flags.extend(bytes([USED | (VERIFIED if verified else 0)]) * n)
        self._sum.extend(checksums)
        self._count += n

    def extend_compact_rows(self, spaces: list[tuple], keys: tuple[bytes, ...],
                            fingerprints: tuple[str, ...], sizes: tuple[int, ...] | array,
                            starts: array, checksums: bytes, *, verified: bool) -> int:
        """``extend_compact`` for a batch whose rows belong to several key spaces (``spaces[i]``
        is row i's): new slots at the end in row order, so the LRU order after a restart is the
        order rows were written across spaces too. Returns the first slot. All or nothing."""
        found = {space: self._spaces.get(space) or self._new_space(space)
                 for space in dict.fromkeys(spaces)}
        first, n = len(self._keys), len(keys)
        done = 0
        try:
            for key, slot, space in zip(keys, range(first, first + n), spaces):
                space_keys = found[space].keys
                if key in space_keys:
                    raise KeyError(f"{(space, key)!r} is indexed twice")
                space_keys[key] = slot
                done += 1
        except KeyError:
            for key, space in zip(keys[:done], spaces):
                del found[space].keys[key]
            for space, entry in found.items():  # spaces made for this batch alone
                if not entry.keys:
                    del self._spaces[space]
                    self._space_list[entry.id] = None
                    self._free_space_ids.append(entry.id)
            raise
        ids = {space: entry.id for space, entry in found.items()}
        self._space.extend(array("I", map(ids.__getitem__, spaces)))
        self._extend_columns(keys, fingerprints, sizes, starts, checksums, verified)
        return first
