"""CPU stand-in for the CuPy calls kvtierd's CUDA control path makes — NOT GPU verification.

See ``../README.md``. Arrays are NumPy arrays; ``cuda`` holds the runtime, driver and objects.
"""

import numpy

from . import cuda
from .cuda import RawModule

__version__ = "0.0.0+cpu-standin"
STANDIN = True  # lets a test or a log line tell this apart from a real CuPy
int64 = numpy.int64
uint8 = numpy.uint8


def asarray(values, dtype=None):
    return numpy.asarray(values, dtype=dtype)


def empty(shape, dtype=float):
    return numpy.empty(shape, dtype=dtype)


__all__ = ["RawModule", "asarray", "cuda", "empty", "int64", "uint8"]
