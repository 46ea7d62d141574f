"""The addresses of functions the ``xxhash`` package's own extension exports (``XXH3_128bits``,
``XXH3_64bits_withSeed``, ...), for the compiled parts that call xxHash without a copy of it in
this project (``kvtierd.copy.memcpy``, ``kvtierd.key_sample``). Each caller checks an address
against the package's Python functions before it uses it."""

from __future__ import annotations

import ctypes
from typing import Iterator

import xxhash


def addresses(names: tuple[str, ...]) -> Iterator[int]:
    """The address of each of ``names`` the extension exports, in order (none at all where the
    extension cannot be opened as a shared library)."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
    except (AttributeError, OSError):
        return
    for name in names:
        try:
            address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        except AttributeError:
            continue
        if address:
            yield address
