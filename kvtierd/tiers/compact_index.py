"""A tier's chunk index in two forms: hot chunks as ``ChunkEntry`` objects, idle ones as columns.

Why: one Python object graph per chunk (entry, runs list, key tuples, two OrderedDict nodes) cost
~830 bytes of daemon memory per indexed chunk, and a node indexes millions. Here every chunk has a
*slot* (a small int) and:

* **active form**: a ``ChunkEntry`` in ``active`` for every chunk someone works with — PENDING,
  referenced by a copy, pinned by a lease, being demoted, or handed out by ``get``/``entry`` since
  the last ``compact``. Callers keep using entry objects and their identity
  (``index.get(k) is entry``) exactly as before; the object is the authority while it exists.
* **compact form**: an idle READY chunk is only its slot's columns (``array`` slabs and one
  ``bytearray`` of checksums) plus its key bytes in one dict per key space.
* **reserved**: a PUT's reservation of a new key made by slot (``CpuTier.reserve_slots``, the
  request path's common case) is PENDING as columns alone, flagged RESERVED (``reserved`` reads
  them as a set), until its copy job
  commits it straight into compact READY form (``commit_reserved``) or aborts it: no entry is
  built and folded per chunk. Lookups, reads and deletes see it as PENDING (a miss, BUSY);
  whoever asks for its entry (``entry``) gets a PENDING one, which then stands for it.
* ``compact()`` folds idle active entries back into columns. The daemon calls it once per loop
  iteration, never a primitive from inside: a handler may hold an entry it got from one primitive
  while calling another, and that object must stay the indexed one until the handler is done.

Keys: ``((tenant, namespace, rank), key)`` as everywhere; one dict per key space maps key bytes to
slots (no tuple per chunk). Fingerprints and spaces are interned as small ints.

Memory of a compact chunk with a 32-byte key: the key's bytes object (~80 B), its dict entry
(~42-84 B), 49 B of columns, 8 B for the key's reference, and the LRU policy's 12-28 B: ~190-250 B
(``tests/unit/kvtierd/tiers/test_compact_index.py`` measures it at 100k chunks;
``benchmarks/index_scale.py`` in a real daemon at 1M). A chunk whose pages are not one contiguous
run keeps its run list in ``_multi`` (a fragmented arena costs more per chunk).
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Hashable, Iterator

from kvtierd.tiers.allocator import Run
from kvtierd.tiers.chunk import ChunkEntry, ChunkState, pending_entry, ready_entry
from kvtierd.tiers.index_batch import BatchEdits
from kvtierd.tiers.index_bulk import BulkLoad
from kvtierd.tiers.index_parts import (  # noqa: F401 (the flags: imported from here by the tiers)
    ACTIVE, CHECKSUM_BYTES, MULTI, ON_NVME, RESERVED, SUMMED, USED, VERIFIED, Interner, KeySpace,
    ReservedSlots)

_READY = ChunkState.READY


class ChunkIndex(BulkLoad, BatchEdits):
    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self._spaces: dict[tuple, KeySpace] = {}
        self._space_list: list[KeySpace | None] = []
        self._free_space_ids: list[int] = []
        self._tenants: dict[str, int] = {}  # tenant -> id (few; kept for the daemon's life)
        self._tenant_names: list[str] = []
        self._fps = Interner()
        # Columns, one item per slot.
        self._space = array("I")
        self._fp = array("I")
        self._nbytes = array("Q")
        self._start = array("Q")  # first page of the chunk's only run (MULTI: see _multi)
        self._sum = bytearray()  # CHECKSUM_BYTES per slot
        self._flags = bytearray()
        self._keys: list[bytes | None] = []
        self._multi: dict[int, list[Run]] = {}
        self._free_slots: list[int] = []
        self.active: dict[int, ChunkEntry] = {}
        self._loose: set[int] = set()  # active slots that may have become idle
        self._count = 0
        # Reads held by slot (``CpuTier.acquire_slots``): slot -> copies in flight that hold it
        # without an entry object. Apart from any entry's ref_count; a held slot is never
        # evicted, and one whose chunk leaves the index meanwhile is *retired* (slot -> the
        # doomed entry that now carries those reads) instead of freed, so that no other chunk
        # takes the slot before its last read is released (``release_retired``).
        self.reads: dict[int, int] = {}
        self.retired: dict[int, ChunkEntry] = {}
        # PUT reservations held by slot (``CpuTier.reserve_slots``): PENDING chunks with no entry
        # object, their columns written but no checksum yet, flagged RESERVED; committed or
        # aborted by slot by the copy job that holds them. Anyone else who asks for one
        # (``entry``) gets a PENDING entry, which from then on is the chunk's authority (the job
        # commits or aborts that entry). ``reserved`` reads them as a set of slots.
        self._reserved_count = 0
        self.reserved = ReservedSlots(self)

    # -- mapping, as callers outside the tiers use it ------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def slot(self, ikey: Hashable) -> int:
        """The slot of ``ikey``, or -1; never builds an entry."""
        space = self._spaces.get(ikey[0])  # type: ignore[index]
        if space is None:
            return -1
        return space.keys.get(ikey[1], -1)  # type: ignore[index]

    def __contains__(self, ikey: Hashable) -> bool:
        return self.slot(ikey) >= 0

    def get(self, ikey: Hashable, default: ChunkEntry | None = None) -> ChunkEntry | None:
        """The entry under ``ikey`` (made active: the same object until the next compact)."""
        slot = self.slot(ikey)
        return default if slot < 0 else self.entry(slot)

    def __getitem__(self, ikey: Hashable) -> ChunkEntry:
        slot = self.slot(ikey)
        if slot < 0:
            raise KeyError(ikey)
        return self.entry(slot)

    def __iter__(self) -> Iterator[Hashable]:
        for space in list(self._spaces.values()):
            for key in list(space.keys):
                yield (space.space, key)

    def keys(self) -> Iterator[Hashable]:
        return iter(self)

    def values(self) -> Iterator[ChunkEntry]:
        """Every entry, for checks and tests: compact ones as read-only snapshots (not indexed
        objects: changing one changes nothing)."""
        for _, entry in self.items():
            yield entry

    def items(self) -> Iterator[tuple[Hashable, ChunkEntry]]:
        for space in list(self._spaces.values()):
            for key, slot in list(space.keys.items()):
                entry = self.active.get(slot)
                yield (space.space, key), entry if entry is not None else self._view(slot)

    # -- slots ---------------------------------------------------------------------------------------
    def entry(self, slot: int) -> ChunkEntry:
        """The active entry of ``slot``, built from its columns if it was compact (a PENDING one
        if it was reserved by slot: the reservation is then that entry's)."""
        entry = self.active.get(slot)
        if entry is None:
            entry = self._view(slot)
            self.active[slot] = entry
            flags = self._flags[slot]
            if flags & RESERVED:  # the reservation is this entry's from now on
                self._reserved_count -= 1
            self._flags[slot] = (flags | ACTIVE) & ~RESERVED
            self._loose.add(slot)
        return entry

    def activate(self, slot: int, ikey: Hashable, fingerprint: str) -> ChunkEntry:
        """``entry(slot)`` of a *compact* slot whose key and fingerprint the caller has just
        matched (a batched lookup): the same entry, built without looking them up again."""
        flags = self._flags[slot]
        assert not flags & RESERVED, f"activate of slot {slot}, a reservation"
        nbytes = self._nbytes[slot]
        runs = (list(self._multi[slot]) if flags & MULTI
                else [(self._start[slot], -(-nbytes // self.page_bytes) or 1)])
        i = slot * CHECKSUM_BYTES
        entry = ready_entry(ikey, fingerprint, nbytes, runs,
                            bytes(self._sum[i:i + CHECKSUM_BYTES]), bool(flags & ON_NVME),
                            bool(flags & VERIFIED), slot)
        self.active[slot] = entry
        self._flags[slot] = flags | ACTIVE
        self._loose.add(slot)
        return entry

    def _view(self, slot: int) -> ChunkEntry:
        flags = self._flags[slot]
        nbytes = self._nbytes[slot]
        space = self._space_list[self._space[slot]]
        assert space is not None
        runs = (list(self._multi[slot]) if flags & MULTI
                else [(self._start[slot], max(1, -(-nbytes // self.page_bytes)))])
        if flags & RESERVED:
            return pending_entry((space.space, self._keys[slot]), self._fps.values[self._fp[slot]],
                                 nbytes, runs, -1, slot)
        i = slot * CHECKSUM_BYTES
        return ready_entry((space.space, self._keys[slot]), self._fps.values[self._fp[slot]],
                           nbytes, runs, bytes(self._sum[i:i + CHECKSUM_BYTES]),
                           bool(flags & ON_NVME), bool(flags & VERIFIED), slot)

    def holds(self, entry: ChunkEntry) -> bool:
        """Whether ``entry`` is the indexed object of its key (``get(entry.ikey) is entry``
        without building an entry for a compact chunk)."""
        return entry.slot >= 0 and self.active.get(entry.slot) is entry

    def mark_copies(self, other: ChunkIndex) -> int:
        """Flag ON_NVME on every chunk whose key ``other`` indexes with the same checksum, and
        clear it on the others (warm restart beside an NVMe tier); returns how many are flagged.
        """
        marked = 0
        for space in list(self._spaces.values()):
            below = other.key_space(space.space)
            below_keys = below.keys if below is not None else {}
            for key, slot in space.keys.items():
                twin = below_keys.get(key, -1)
                same = twin >= 0 and other.checksum_of(twin) == self.checksum_of(slot)
                self.set_on_nvme(slot, same)
                marked += same
        return marked

    def is_active(self, slot: int) -> bool:
        return bool(self._flags[slot] & ACTIVE)

    def tenant_id(self, slot: int) -> int:
        """The interned tenant of ``slot`` (the eviction policy's partition)."""
        return self._space_list[self._space[slot]].tenant  # type: ignore[union-attr]

    def tenant_name(self, tenant_id: int) -> str:
        return self._tenant_names[tenant_id]

    def tenant_number(self, tenant: str) -> int:
        """The interned id of ``tenant``, or -1 if no chunk of it was ever indexed."""
        return self._tenants.get(tenant, -1)

    def pages_of(self, slot: int) -> int:
        if self._flags[slot] & MULTI:
            return sum(count for _, count in self._multi[slot])
        return max(1, -(-self._nbytes[slot] // self.page_bytes))

    def nbytes_of(self, slot: int) -> int:
        return self._nbytes[slot]

    def checksum_of(self, slot: int) -> bytes:
        entry = self.active.get(slot)
        if entry is not None:
            return entry.checksum
        i = slot * CHECKSUM_BYTES
        return bytes(self._sum[i:i + CHECKSUM_BYTES])

    def checksum_column(self, slot: int) -> bytes:
        i = slot * CHECKSUM_BYTES
        return bytes(self._sum[i:i + CHECKSUM_BYTES])

    def set_on_nvme(self, slot: int, on_nvme: bool) -> None:
        entry = self.active.get(slot)
        if entry is not None:
            entry.on_nvme = on_nvme
        elif on_nvme:
            self._flags[slot] |= ON_NVME
        else:
            self._flags[slot] &= ~ON_NVME & 0xFF

    def fingerprint_id(self, fingerprint: str) -> int:
        """The interned id of ``fingerprint``, or -1 when no indexed chunk has it."""
        return self._fps.ids.get(fingerprint, -1)

    def fingerprint_covers_all(self, fp_id: int) -> bool:
        """Whether every indexed chunk has the interned fingerprint ``fp_id`` (a daemon serving
        one layout): a batched lookup's hits then need no per-chunk layout check."""
        return fp_id >= 0 and self._fps.refs[fp_id] == self._count

    def key_space(self, space: tuple) -> KeySpace | None:
        """One key space: ``.keys`` (key -> slot, read-only for callers) and ``.tenant``."""
        return self._spaces.get(space)

    @property
    def fp_column(self) -> array:
        """Interned fingerprint per slot (read-only; compare with ``fingerprint_id``)."""
        return self._fp

    @property
    def start_column(self) -> array:
        """First page per slot (read-only; a MULTI slot's chunk has more runs)."""
        return self._start

    @property
    def nbytes_column(self) -> array:
        """Payload bytes per slot (read-only)."""
        return self._nbytes

    @property
    def flags(self) -> bytearray:
        """Flag bits per slot (read-only): USED, ACTIVE, ON_NVME, VERIFIED, MULTI, SUMMED,
        RESERVED."""
        return self._flags

    # -- changes -------------------------------------------------------------------------------------
    def add(self, entry: ChunkEntry) -> None:
        """Index a new entry (active) under ``entry.ikey``, which must be free."""
        space, key = entry.ikey  # type: ignore[misc]
        slot = self._new_slot(space, key, entry.fingerprint, entry.nbytes, entry.runs)
        self._flags[slot] = USED | ACTIVE | (MULTI if len(entry.runs) != 1 else 0)
        entry.slot = slot
        self.active[slot] = entry
        if entry.state is _READY:
            self._loose.add(slot)

    def add_many(self, space: tuple, fingerprint: str, entries: list[ChunkEntry]) -> None:
        """``add`` of new single-run entries of one key space and one fingerprint (a PUT's
        reservations: their keys are free and distinct), with the space and the fingerprint
        looked up once instead of per entry."""
        found = self._spaces.get(space)
        if found is None:
            found = self._new_space(space)
        keys, active, free = found.keys, self.active, self._free_slots
        fp, sid, flag = self._fps.take_many(fingerprint, len(entries)), found.id, USED | ACTIVE
        for entry in entries:
            key = entry.ikey[1]
            assert key not in keys and len(entry.runs) == 1, f"{entry.ikey!r} cannot be added"
            if free:
                slot = free.pop()
                self._space[slot] = sid
                self._fp[slot] = fp
                self._nbytes[slot] = entry.nbytes
                self._start[slot] = entry.runs[0][0]
                self._keys[slot] = key
                self._flags[slot] = flag
            else:
                slot = len(self._keys)
                self._space.append(sid)
                self._fp.append(fp)
                self._nbytes.append(entry.nbytes)
                self._start.append(entry.runs[0][0])
                self._keys.append(key)
                self._flags.append(flag)
                self._sum.extend(bytes(CHECKSUM_BYTES))
            keys[key] = slot
            entry.slot = slot
            active[slot] = entry
        self._count += len(entries)

    def _new_slot(self, space: tuple, key: bytes, fingerprint: str, nbytes: int,
                  runs: list[Run]) -> int:
        found = self._spaces.get(space)
        if found is None:
            found = self._new_space(space)
        if key in found.keys:
            raise KeyError(f"{(space, key)!r} is indexed already")
        if self._free_slots:
            slot = self._free_slots.pop()
            self._space[slot] = found.id
            self._fp[slot] = self._fps.take(fingerprint)
            self._nbytes[slot] = nbytes
            self._start[slot] = runs[0][0]
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            self._space.append(found.id)
            self._fp.append(self._fps.take(fingerprint))
            self._nbytes.append(nbytes)
            self._start.append(runs[0][0])
            self._keys.append(key)
            self._flags.append(0)
            self._sum.extend(bytes(CHECKSUM_BYTES))
        if len(runs) != 1:
            self._multi[slot] = list(runs)
        found.keys[key] = slot
        self._count += 1
        return slot

    def _new_space(self, space: tuple) -> KeySpace:
        tenant = self._tenants.get(space[0])
        if tenant is None:
            tenant = self._tenants[space[0]] = len(self._tenants)
            self._tenant_names.append(space[0])
        if self._free_space_ids:
            sid = self._free_space_ids.pop()
        else:
            sid = len(self._space_list)
            self._space_list.append(None)
        found = self._space_list[sid] = self._spaces[space] = KeySpace(space, sid, tenant)
        return found

    def discard(self, entry: ChunkEntry) -> None:
        """Unindex ``entry`` (the indexed object); its slot is free for reuse, or retired while
        reads hold it by slot (the caller has moved them onto the entry, which is doomed)."""
        slot = entry.slot
        assert slot >= 0 and self.active.get(slot) is entry, f"{entry.ikey!r} is not indexed"
        del self.active[slot]
        self._loose.discard(slot)
        entry.slot = -1
        held = slot in self.reads  # copies still read it by slot: reused once they are done
        self._unindex(slot, reuse=not held)
        if held:
            self.retired[slot] = entry

    def release_retired(self, slot: int) -> None:
        """The last read held by ``slot`` of a retired chunk is done: the slot is free."""
        assert slot not in self.reads and not self._flags[slot], f"slot {slot} is still read"
        del self.retired[slot]
        self._free_slots.append(slot)

    def _unindex(self, slot: int, reuse: bool = True) -> None:
        space = self._space_list[self._space[slot]]
        assert space is not None
        del space.keys[self._keys[slot]]  # type: ignore[arg-type]
        if not space.keys:
            del self._spaces[space.space]
            self._space_list[space.id] = None
            self._free_space_ids.append(space.id)
        self._fps.release(self._fp[slot])
        self._keys[slot] = None
        self._flags[slot] = 0
        self._multi.pop(slot, None)
        if reuse:
            self._free_slots.append(slot)
        self._count -= 1

    def set_runs(self, entry: ChunkEntry, runs: list[Run]) -> None:
        """Record that the indexed ``entry`` now holds ``runs`` (its first page unchanged: a
        promotion's spare pages freed from the tail)."""
        slot = entry.slot
        assert slot >= 0 and self.active.get(slot) is entry, f"{entry.ikey!r} is not indexed"
        assert runs and runs[0][0] == self._start[slot], "a chunk's first page never moves"
        if len(runs) == 1:
            self._multi.pop(slot, None)
            self._flags[slot] &= ~MULTI
        else:
            self._multi[slot] = list(runs)
            self._flags[slot] |= MULTI

    def loosen(self, entry: ChunkEntry) -> None:
        """``entry`` may have become idle: the next ``compact`` looks at it."""
        if entry.slot >= 0:
            self._loose.add(entry.slot)

    def fold(self, entries: list[ChunkEntry]) -> None:
        """``compact`` of entries just committed that nobody holds any more (a PUT job whose
        entries nothing else wants: no kv-events, no tier below): READY, unreferenced and
        unpinned by construction, folded now rather than looked at again next iteration."""
        active, flags, sums, loose = self.active, self._flags, self._sum, self._loose
        for entry in entries:
            slot, checksum = entry.slot, entry.checksum
            assert entry.state is _READY and not (entry.ref_count or entry.pin_count
                                                  or entry.demoting or entry.on_nvme)
            if len(checksum) != CHECKSUM_BYTES:
                loose.add(slot)  # stays an entry (compact leaves it too)
                continue
            i = slot * CHECKSUM_BYTES
            sums[i:i + CHECKSUM_BYTES] = checksum
            flags[slot] = ((flags[slot] & (USED | MULTI)) | SUMMED
                           | (VERIFIED if entry.verified else 0))
            del active[slot]

    def compact(self) -> int:
        """Fold every loose, idle (READY, unreferenced, unpinned, not demoting) entry back into
        columns; returns how many. Only at a point where no caller holds an entry it got from a
        primitive without referencing or pinning it (the daemon: between loop iterations)."""
        folded = 0
        active, flags, sums = self.active, self._flags, self._sum
        for slot in self._loose:
            entry = active.get(slot)
            if (entry is None or entry.state is not _READY or entry.ref_count or entry.pin_count
                    or entry.demoting or entry.doomed or len(entry.checksum) != CHECKSUM_BYTES):
                continue
            if not flags[slot] & SUMMED:  # a new commit; a chunk's checksum never changes after
                i = slot * CHECKSUM_BYTES
                sums[i:i + CHECKSUM_BYTES] = entry.checksum
            flags[slot] = ((flags[slot] & (USED | MULTI)) | SUMMED
                           | (ON_NVME if entry.on_nvme else 0) | (VERIFIED if entry.verified else 0))
            del active[slot]
            folded += 1
        self._loose.clear()
        return folded

    def clear(self) -> None:
        self.__init__(self.page_bytes)  # type: ignore[misc]

    # -- checks --------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        used = 0
        for space in self._spaces.values():
            assert self._space_list[space.id] is space, f"space {space.space!r} lost its id"
            assert space.keys, f"empty key space {space.space!r} kept"
            for key, slot in space.keys.items():
                assert self._keys[slot] == key and self._space[slot] == space.id, (
                    f"slot {slot} does not hold {key!r}")
                assert self._flags[slot] & USED, f"slot {slot} indexed but free"
                used += 1
        assert used == self._count, f"index counts {self._count} chunks, holds {used}"
        for slot, entry in self.active.items():
            assert entry.slot == slot and self._flags[slot] & ACTIVE, f"active slot {slot} drifted"
            space = self._space_list[self._space[slot]]
            assert space is not None and entry.ikey == (space.space, self._keys[slot])
            assert entry.fingerprint == self._fps.values[self._fp[slot]]
            assert entry.nbytes == self._nbytes[slot] and entry.runs[0][0] == self._start[slot]
            assert bool(self._flags[slot] & MULTI) == (len(entry.runs) != 1)
            assert not self._flags[slot] & SUMMED or entry.checksum == self.checksum_column(slot), (
                f"slot {slot}: its checksum column is stale")
        reserved = list(self.reserved)
        assert len(reserved) == self._reserved_count, (
            f"the index counts {self._reserved_count} reservations, flags {len(reserved)}")
        for slot in reserved:
            assert self._flags[slot] & (USED | ACTIVE | MULTI | SUMMED) == USED, (
                f"reserved slot {slot} is not a one-run PENDING chunk without an entry")
        actives = sum(1 for f in self._flags if f & ACTIVE)
        assert actives == len(self.active), "ACTIVE flags and active entries disagree"
        assert len(self._free_slots) + len(self.retired) == len(self._keys) - self._count, (
            "free slots drifted")
        for slot, count in self.reads.items():
            assert count > 0 and (self._flags[slot] & USED or slot in self.retired), (
                f"slot {slot}: {count} reads on a free slot")
        for slot, entry in self.retired.items():
            assert slot in self.reads and not self._flags[slot] and entry.doomed, (
                f"retired slot {slot} drifted")
            assert entry.ref_count >= self.reads[slot], f"retired slot {slot} lost its reads"
        assert all(not self._flags[s] for s in self._free_slots), "a free slot is still in use"
        fps = Counter(self._fp[s] for space in self._spaces.values() for s in space.keys.values())
        assert {i: n for i, n in enumerate(self._fps.refs) if n} == fps, (
            "fingerprint references drifted")
