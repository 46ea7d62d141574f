"""Loading idle READY chunks straight into ``ChunkIndex``'s columns (recovery after a restart):
no ``ChunkEntry`` per chunk, and for a batch of single-run rows, C-level extends of every column.
``ChunkIndex`` mixes it in; the columns, key spaces and interners it fills are ChunkIndex's
(``kvtierd.tiers.compact_index`` says what each holds)."""

from __future__ import annotations

import collections
from array import array
from itertools import compress

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

    # -- snapshots (``kvtierd.tiers.index_snapshot``) ----------------------------------------------
    def export_columns(self, order: list[int]) -> dict:
        """The idle chunks of ``order`` (slots, coldest first: every indexed chunk, none active)
        as columns in that order, for a snapshot: item i of each describes the chunk that will
        be slot i after ``import_columns``. Spaces and fingerprints are renumbered from 0.
        C-level passes over the columns (a clean stop of a 1M-chunk tier waits for them)."""
        assert len(order) == self._count and not self.active, "only an idle index is exported"
        spaces = [space for space in self._space_list if space is not None]  # each has keys
        space_ids = array("I", bytes(4 * len(self._space_list)))
        for i, space in enumerate(spaces):
            space_ids[space.id] = i
        fp_list = [i for i, value in enumerate(self._fps.values) if value is not None]
        fp_ids = array("I", bytes(4 * len(self._fps.values)))
        for i, fid in enumerate(fp_list):
            fp_ids[fid] = i
        keys = list(map(self._keys.__getitem__, order))
        new_space = array("I", map(space_ids.__getitem__, map(self._space.__getitem__, order)))
        if len(spaces) == 1:
            key_dicts = [dict(zip(keys, range(len(keys))))]
        else:
            key_dicts = []
            for i in range(len(spaces)):
                slots = list(compress(range(len(keys)), map(i.__eq__, new_space)))
                key_dicts.append(dict(zip(map(keys.__getitem__, slots), slots)))
        sums = self._sum
        at = [slot * CHECKSUM_BYTES for slot in order]
        multi = {}
        if self._multi:
            multi = {new: list(self._multi[old]) for new, old in enumerate(order)
                     if self._flags[old] & MULTI}
        return {
            "spaces": [space.space for space in spaces],
            "fingerprints": [self._fps.values[fid] for fid in fp_list],
            "space": new_space,
            "fp": array("I", map(fp_ids.__getitem__, map(self._fp.__getitem__, order))),
            "nbytes": array("Q", map(self._nbytes.__getitem__, order)),
            "start": array("Q", map(self._start.__getitem__, order)),
            "sums": b"".join(map(sums.__getitem__, map(slice, at, map(
                CHECKSUM_BYTES.__add__, at)))),
            "keys": keys,
            "key_dicts": key_dicts,
            "multi": multi,
        }

    def import_columns(self, columns: dict, *, verified: bool) -> None:
        """Fill an empty index with ``export_columns``' output: slot i is its item i, every
        chunk idle READY, flags as recovery sets them (``verified`` per tier, no ON_NVME)."""
        assert not self._count and not self._keys, "a snapshot is loaded into an empty index"
        n = len(columns["keys"])
        sids = [self._new_space(tuple(space)).id for space in columns["spaces"]]
        for sid, keys in zip(sids, columns["key_dicts"]):
            space = self._space_list[sid]
            assert space is not None
            space.keys = keys
        space_col = columns["space"]
        if sids != list(range(len(sids))):  # a fresh index numbers them from 0: never remapped
            space_col = array("I", map(sids.__getitem__, space_col))
        fps = columns["fingerprints"]
        fp_col = columns["fp"]
        counts = {0: n} if len(fps) == 1 else collections.Counter(fp_col)
        fids = {i: self._fps.take_many(fps[i], count)  # only fingerprints some chunk has
                for i, count in sorted(counts.items()) if count}
        if any(i != fid for i, fid in fids.items()):
            fp_col = array("I", map(fids.__getitem__, fp_col))
        self._space, self._fp = space_col, fp_col
        self._nbytes, self._start = columns["nbytes"], columns["start"]
        self._sum = bytearray(columns["sums"])
        self._keys = columns["keys"]
        self._flags = bytearray([USED | SUMMED | (VERIFIED if verified else 0)]) * n
        self._multi = {slot: [tuple(run) for run in runs]
                       for slot, runs in columns["multi"].items()}
        for slot in self._multi:
            self._flags[slot] |= MULTI
        self._count = n
