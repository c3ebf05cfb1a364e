"""Raising stand-ins for the ``sgl_kernel`` names SGLang imports on CUDA but a dense-Llama forward with the
GPU server check's settings never calls (see ../README.md)."""

from __future__ import annotations


class StandInMissing(NotImplementedError):
    pass


def stub(qualname: str):
    def call(*args, **kwargs):
        raise StandInMissing(
            f"{qualname}: not provided by the GPU server check's sgl_kernel stand-ins (scripts/gpu_standins)"
        )

    call.__name__ = call.__qualname__ = qualname.rsplit(".", 1)[-1]
    return call


def define(namespace: dict, module: str, names: tuple[str, ...]) -> None:
    for name in names:
        namespace[name] = stub(f"{module}.{name}")
