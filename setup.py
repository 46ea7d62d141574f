"""The compiled parts of kvtierd, each a small C file doing what a PUT or GET batch of small chunks
did in per-item Python: kvtierd.copy._ranges (a copy job's memmoves and checksums),
kvtierd.tiers._columns (a batch's reads and writes of the index's columns), kvtierd.server._items
(a batch's items checked as columns), kvtierd.eviction._stamps (an LRU's batch of stamps),
kvtierd._key_sample (the keys the ghosts simulate) and kvtierd._ghost (the ghosts' LRU).

Everything else is declared in pyproject.toml; setuptools reads extension modules from here (its
pyproject table for them is still experimental). The extensions are optional: where no C compiler
is at hand the build goes on without them: kvtierd.copy.memcpy copies with ctypes, one call per
chunk, and kvtierd.tiers.columns, kvtierd.server.requests, kvtierd.eviction.lru,
kvtierd.key_sample and kvtierd.ghost run their Python forms (slower for small chunks; the same
bytes, index and answers); the daemon logs which run.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(name, [source], extra_compile_args=["-O2"], optional=True)
                   for name, source in (("kvtierd.copy._ranges", "kvtierd/copy/_ranges.c"),
                                        ("kvtierd.tiers._columns", "kvtierd/tiers/_columns.c"),
                                        ("kvtierd.server._items", "kvtierd/server/_items.c"),
                                        ("kvtierd.eviction._stamps", "kvtierd/eviction/_stamps.c"),
                                        ("kvtierd._key_sample", "kvtierd/_key_sample.c"),
                                        ("kvtierd._ghost", "kvtierd/_ghost.c"))])
