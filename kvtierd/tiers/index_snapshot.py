"""A tier's index as one file, written at a clean stop and loaded by the next start instead of
the rows (``kvtierd.tiers.index_restore`` decides when).

Why: a restart with a million chunks spent ~1 s in Python's sqlite3 building row tuples and
another ~0.8 s decoding them and filling the key dicts; this file holds the compact index's own
columns, so a start reads it in one ``read``, checks one xxh3-128 and hands the columns to the
index (``ChunkIndex.import_columns``) with C-level copies. The rows stay the authority: the file
is used only when the index database's meta names its random token (``ChunkIndexDB``), and any
write to the database clears that token first.

Layout (little-endian)::

    MAGIC (8) | u32 header length | header (msgpack map) | sections | xxh3-128 of header + sections

The header has the format version, the database's schema and meta (page size, tier bytes), the
tier's page count, the token, the counts and each section's length. Sections, in order: the
space, fingerprint, nbytes and first-page columns (``array`` bytes), the checksums (16 bytes per
chunk), the page map (one byte per page, 1 = used: the allocator's free extents come from it as
recovery builds them), and one ``marshal`` blob with the keys (a list, slot order), one
key -> slot dict per key space (the same key objects: marshal stores each once), the key spaces,
the fingerprints and the runs of multi-run chunks. marshal because it builds a million bytes
objects and dicts in C (~0.1 s for the keys, where slicing a blob took 0.35 s); its format
version is in the header and another one is refused. Item i of every column is the chunk that
becomes slot i, and slots are numbered coldest first, so the eviction order is slot order.
"""

from __future__ import annotations

import marshal
import os
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

import msgpack
import xxhash

MAGIC = b"KVTIDXS\0"
FORMAT_VERSION = 1
FILE_MODE = 0o600  # as the index: it names tenants, namespaces and prefix hashes
_LEN = struct.Struct("<I")
_DIGEST = 16
_ARRAYS = (("space", "I"), ("fp", "I"), ("nbytes", "Q"), ("start", "Q"))


class SnapshotRejected(Exception):
    """The file cannot stand for the rows; ``damaged`` says whether it is broken or stale
    (logged as a warning) rather than simply absent (info)."""

    def __init__(self, reason: str, damaged: bool = True) -> None:
        super().__init__(reason)
        self.damaged = damaged


@dataclass(frozen=True)
class Snapshot:
    columns: dict  # ``ChunkIndex.import_columns``' input
    page_map: bytearray
    pages: int
    tenant_pages: dict[str, int]


def path_for(index_path: Path) -> Path:
    """Beside the index, its suffix kept: ``/dev/shm/<arena>.snapshot.index``,
    ``<nvme_dir>/index.snapshot.sqlite``. Why not ``<index>.snapshot``: a daemon of an older
    version reclaims every ``kvtierd-*`` file in /dev/shm that does not end like an index
    (``arena.INDEX_SUFFIXES``) and has no ``.index`` beside it, as a dead daemon's arena."""
    return index_path.with_name(f"{index_path.stem}.snapshot{index_path.suffix}")


def temp_path_for(index_path: Path) -> Path:
    return _temp(path_for(index_path))


def _temp(path: Path) -> Path:
    """Where ``path`` is written before its rename (same suffix: see ``path_for``)."""
    return path.with_name(f"{path.stem}-tmp{path.suffix}")


def write(path: Path, *, meta: dict[str, str], num_pages: int, token: str, columns: dict,
          page_map: bytearray, pages: int, tenant_pages: dict[str, int]) -> int:
    """Write the snapshot to a temporary name, fsync it, rename it over ``path`` and fsync the
    directory; returns its size. OSError on any failure (the temporary file is removed)."""
    objects = marshal.dumps({name: columns[name] for name in
                             ("keys", "key_dicts", "spaces", "fingerprints", "multi")})
    sections = [columns[name].tobytes() for name, _ in _ARRAYS]
    sections += [bytes(columns["sums"]), bytes(page_map), objects]
    header = msgpack.packb({
        "format": FORMAT_VERSION, "meta": meta, "num_pages": num_pages, "token": token,
        "chunks": len(columns["keys"]), "pages": pages, "tenant_pages": tenant_pages,
        "marshal": marshal.version, "byteorder": sys.byteorder,
        "sections": [len(s) for s in sections]})
    digest = xxhash.xxh3_128(header)
    for section in sections:
        digest.update(section)
    tmp = _temp(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb", closefd=False) as out:
            for piece in (MAGIC, _LEN.pack(len(header)), header, *sections, digest.digest()):
                out.write(piece)
        os.fsync(fd)
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def read(path: Path, *, token: str, meta: dict[str, str], num_pages: int) -> Snapshot:
    """The snapshot at ``path`` if it stands for the index whose meta is ``meta`` and whose
    database names ``token``; else SnapshotRejected with the reason."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotRejected("no snapshot", damaged=False) from None
    except OSError as exc:
        raise SnapshotRejected(f"unreadable: {exc}") from None
    view = memoryview(data)
    head_end = len(MAGIC) + _LEN.size
    if len(data) < head_end + _DIGEST or data[:len(MAGIC)] != MAGIC:
        raise SnapshotRejected(f"not a snapshot ({len(data)} bytes, magic {data[:8]!r})")
    (header_len,) = _LEN.unpack_from(data, len(MAGIC))
    body_end = len(data) - _DIGEST
    if head_end + header_len > body_end:
        raise SnapshotRejected(f"truncated: a {header_len}-byte header in {len(data)} bytes")
    if xxhash.xxh3_128_digest(view[head_end:body_end]) != data[body_end:]:
        raise SnapshotRejected("checksum mismatch (damaged or truncated)")
    try:
        header = msgpack.unpackb(view[head_end:head_end + header_len])
        _check_header(header, token, meta, num_pages, body_end - head_end - header_len)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise SnapshotRejected(f"unusable header: {exc}") from None
    return _sections(view, head_end + header_len, header)


def _check_header(header: dict, token: str, meta: dict[str, str], num_pages: int,
                  body_bytes: int) -> None:
    if header["format"] != FORMAT_VERSION:
        raise SnapshotRejected(f"format {header['format']!r}, this build reads {FORMAT_VERSION}")
    if not token or header["token"] != token:
        raise SnapshotRejected("stale: its token is not the one the index database names")
    if header["meta"] != meta or header["num_pages"] != num_pages:
        raise SnapshotRejected(
            f"another geometry: {header['meta']!r} over {header['num_pages']} pages, the index"
            f" is {meta!r} over {num_pages}")
    if header["marshal"] != marshal.version or header["byteorder"] != sys.byteorder:
        raise SnapshotRejected(f"written by marshal {header['marshal']} ({header['byteorder']})"
                               f", this Python has {marshal.version} ({sys.byteorder})")
    if sum(header["sections"]) != body_bytes:
        raise SnapshotRejected(f"sections of {sum(header['sections'])} bytes in {body_bytes}")


def _sections(view: memoryview, pos: int, header: dict) -> Snapshot:
    n = header["chunks"]
    sizes = iter(header["sections"])
    columns: dict = {}
    for name, code in _ARRAYS:
        size = next(sizes)
        column = array(code)
        column.frombytes(view[pos:pos + size])
        pos += size
        if len(column) != n:
            raise SnapshotRejected(f"column {name} has {len(column)} items for {n} chunks")
        columns[name] = column
    size = next(sizes)
    columns["sums"] = view[pos:pos + size]
    pos += size
    size = next(sizes)
    page_map = bytearray(view[pos:pos + size])
    pos += size
    try:
        objects = marshal.loads(view[pos:pos + next(sizes)])
        columns.update((name, objects[name]) for name in
                       ("keys", "key_dicts", "spaces", "fingerprints", "multi"))
    except (ValueError, EOFError, TypeError, KeyError) as exc:
        raise SnapshotRejected(f"unusable keys: {exc}") from None
    snap = Snapshot(columns, page_map, header["pages"], header["tenant_pages"])
    _check_counts(snap, n, header["num_pages"])
    return snap


def _check_counts(snap: Snapshot, n: int, num_pages: int) -> None:
    """Cheap whole-column checks that the parts agree (the checksum guards their bytes; these
    guard against a writer that disagrees with this reader)."""
    c = snap.columns
    problems = []
    if len(c["sums"]) != 16 * n:
        problems.append(f"{len(c['sums'])} checksum bytes")
    if len(c["keys"]) != n or sum(map(len, c["key_dicts"])) != n:
        problems.append(f"{len(c['keys'])} keys")
    if len(c["key_dicts"]) != len(c["spaces"]) or (n and max(c["space"]) >= len(c["spaces"])):
        problems.append(f"{len(c['spaces'])} key spaces")
    if n and max(c["fp"]) >= len(c["fingerprints"]):
        problems.append(f"{len(c['fingerprints'])} fingerprints")
    if any(not 0 <= slot < n for slot in c["multi"]):
        problems.append("a multi-run chunk beyond the chunks")
    if (len(snap.page_map) != num_pages or snap.page_map.count(1) != snap.pages
            or sum(snap.tenant_pages.values()) != snap.pages):
        problems.append(f"a page map of {snap.page_map.count(1)} used pages for {snap.pages}")
    if problems:
        raise SnapshotRejected(f"inconsistent ({', '.join(problems)} for {n} chunks)")
