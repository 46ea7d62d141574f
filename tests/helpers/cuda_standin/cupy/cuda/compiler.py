"""CPU stand-in (see ../../README.md): the exception kvtier_client catches around NVRTC."""


class CompileException(Exception):
    pass
