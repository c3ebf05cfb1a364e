"""The KV pool writer: the only code that writes fetched KV into SGLang's paged KV pool (writer.py)."""

from .writer import KVWriteError, KVWriter, PoolTensors, writer_for

__all__ = ["KVWriteError", "KVWriter", "PoolTensors", "writer_for"]
