"""CPU stand-in (see ../../README.md) for the driver call kvtierd needs: cuMemGetAddressRange."""

from . import runtime


class CUDADriverError(RuntimeError):
    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(f"CUDA_ERROR {status}: {message}")
        self.status = status


def memGetAddressRange(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the allocation or opened handle holding ``ptr``."""
    runtime._check_context()
    found = runtime._region(ptr, 1)
    if found is None:
        raise CUDADriverError(1, f"0x{ptr:x} is in no allocation (CUDA_ERROR_INVALID_VALUE)")
    return found
