"""The device writer's upload of a write's host arrays ("parts") into its device staging buffer.

Each part (its pieces stacked along axis 0, cast to the part's dtype) lands at a 64-byte aligned offset of
the device buffer, followed by ``out_bytes`` for the kernels' output. A piece that lies in a registered
(pinned) host region in the part's dtype is uploaded from where it is; consecutive such pieces whose host
addresses are as far apart as their device offsets (a staged codes record: ``rows.RowStore`` lays a
record's arrays out 64-byte aligned, in the order the writer uploads them) go in ONE H2D copy. Other
pieces are written into the pinned staging buffer and uploaded in one copy per contiguous run.

Threads: the writer's lock (its staging buffers and ops).
"""

from __future__ import annotations

import numpy as np
import torch

from .arena import align

_TORCH = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int64): torch.int64,
}


def upload_parts(
    writer, parts: list[list[np.ndarray]], out_bytes: int, dtypes: list | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """See module docstring. ``writer``: a ``DeviceKVWriter`` (its ``staging``, ``ops``, ``regions``,
    ``stats``). Returns the device buffer, a device view of each part (its dtype and shape), the offset of
    the output bytes."""
    dtypes = [np.dtype(d) for d in dtypes] if dtypes else [p[0].dtype for p in parts]
    shapes = [(sum(a.shape[0] for a in p), *p[0].shape[1:]) for p in parts]
    sizes = [int(np.prod(sh)) * dt.itemsize for sh, dt in zip(shapes, dtypes, strict=True)]
    offs, n = [], 0
    for nbytes in sizes:
        offs.append(n)
        n = align(n + nbytes)
    host_t = writer.staging.host(n)
    host = host_t.numpy()
    dev = writer.staging.device(n + out_bytes)
    staged: list[list[int]] = []  # [start, end) byte runs of the staging buffer to upload
    run_open = False  # the last run may grow over alignment padding (never over a zero-copy piece)
    zero: list[list] = []  # [device start, device end, host address, region] runs uploaded in place
    zero_open = False  # the last zero-copy run may grow (no staged piece since)
    for o, nbytes, sh, dt, pieces in zip(offs, sizes, shapes, dtypes, parts, strict=True):
        row = nbytes // max(sh[0], 1)
        lo = 0
        for a in pieces:
            at, size = o + lo * row, a.shape[0] * row
            lo += a.shape[0]
            if size == 0:  # nothing to upload; runs on either side may still join
                continue
            region = writer.region_of(a) if a.dtype == dt else None
            if region is not None:
                ptr = a.__array_interface__["data"][0]
                last = zero[-1] if zero and zero_open else None
                if (
                    last is not None
                    and last[3] is region
                    and ptr - last[2] == at - last[0] >= last[1] - last[0]
                ):
                    last[1] = at + size  # the bytes between (alignment padding) come along
                else:
                    zero.append([at, at + size, ptr, region])
                writer.stats["zero_copy_parts"] += 1
                run_open, zero_open = False, True
            else:
                host[at : at + size].view(dt).reshape(a.shape)[...] = a  # numpy casts (fp16 -> f32)
                if run_open:
                    staged[-1][1] = at + size
                else:
                    staged.append([at, at + size])
                run_open, zero_open = True, False
    for d0, d1, ptr, (start, _, array) in zero:
        src = array.reshape(-1).view(np.uint8)[ptr - start : ptr - start + d1 - d0]
        writer.ops.upload(dev[d0:d1], torch.from_numpy(src))
    for a, b in staged:
        writer.ops.upload(dev[a:b], host_t[a:b])
    views = [
        dev[o : o + nbytes].view(_TORCH[dt]).view(sh)
        for o, nbytes, sh, dt in zip(offs, sizes, shapes, dtypes, strict=True)
    ]
    return dev, views, n
