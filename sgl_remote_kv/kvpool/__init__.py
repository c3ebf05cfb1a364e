"""The KV writers: the only code that writes fetched KV into SGLang's paged KV pool (``writer.py``: the
contract and the host writer; ``device_writer.py``: device pools) and the host staging the fetch paths
write into (``staged.py``, ``rows.py``). ``writer_for`` picks the pool's writer."""

from sgl_remote_kv.types import KVLayout

from .writer import DEFAULT_TIMEOUT_S, TORCH_DTYPES, HostKVWriter, KVWriteError, KVWriter, PoolTensors

__all__ = ["KVWriteError", "KVWriter", "PoolTensors", "writer_for"]


def writer_for(
    pool: PoolTensors, layout: KVLayout, timeout_s: float = DEFAULT_TIMEOUT_S, ops=None
) -> KVWriter:
    """The writer for the pool's device: ``HostKVWriter`` on CPU, ``DeviceKVWriter`` over ``ops`` on a
    device (``cuda_ops.CudaOps`` unless given: the test suite passes its strict CPU double)."""
    dev = pool.k[0].device
    for t in (*pool.k, *pool.v):
        if t.device != dev or t.dtype != TORCH_DTYPES[layout.dtype] or not t.is_contiguous():
            raise ValueError("pool tensors must share one device and the layout's dtype, and be contiguous")
    if dev.type == "cpu":
        return HostKVWriter(pool, layout, timeout_s)
    if dev.type == "cuda":
        from .device_writer import DeviceKVWriter

        if ops is None:
            from .cuda_ops import CudaOps

            ops = CudaOps(dev)
        return DeviceKVWriter(pool, layout, ops, timeout_s)
    raise ValueError(f"no KV writer for pools on {dev}")
