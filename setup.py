"""The one compiled part of kvtierd: kvtierd.copy._ranges (kvtierd/copy/_ranges.c).

Everything else is declared in pyproject.toml; setuptools reads extension modules from here (its
pyproject table for them is still experimental). The extension is optional: where no C compiler
is at hand the build goes on without it and kvtierd.copy.memcpy copies with ctypes, one call per
chunk, as before (slower for small chunks, the same bytes); the daemon logs which one it runs.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtierd.copy._ranges", ["kvtierd/copy/_ranges.c"],
                             extra_compile_args=["-O2"], optional=True)])
