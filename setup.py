"""The compiled parts of kvtierd: kvtierd.copy._ranges (kvtierd/copy/_ranges.c: a copy job's
memmoves and checksums) and kvtierd.tiers._columns (kvtierd/tiers/_columns.c: a batch's writes
into the index's columns).

Everything else is declared in pyproject.toml; setuptools reads extension modules from here (its
pyproject table for them is still experimental). The extensions are optional: where no C compiler
is at hand the build goes on without them: kvtierd.copy.memcpy copies with ctypes, one call per
chunk, and kvtierd.tiers.columns writes columns in Python loops (slower for small chunks, the same
bytes and index); the daemon logs which ones it runs.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(name, [source], extra_compile_args=["-O2"], optional=True)
                   for name, source in (("kvtierd.copy._ranges", "kvtierd/copy/_ranges.c"),
                                        ("kvtierd.tiers._columns", "kvtierd/tiers/_columns.c"))])
