"""CPU stand-in for ``cupyx`` (see ../README.md): pinned host arrays are plain NumPy arrays."""

import numpy


def empty_pinned(shape, dtype=float):
    return numpy.empty(shape, dtype=dtype)
