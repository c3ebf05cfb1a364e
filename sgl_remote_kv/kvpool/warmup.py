"""Compile the device writer's kernels at start-up, before the first request needs them.

Triton compiles a kernel variant on its first launch (0.5-3 s each on a GPU). Left to the first fetch,
that happens on a latency path: the DPU client's receiver thread (a stall past the data plane's
heartbeat timeout reads as a hung data plane, and the fetch becomes a miss), a forward pass (layer-wise
installs) or the scheduler thread. ``warm_up`` runs every kind of write the serving process can issue
once, through the writer's own code, so each variant is compiled (and cached by Triton) on the thread
that builds the tier, before the server takes requests.

What it covers, for a pool's layout and the codecs given: a plain KV write (the scatter: the linker's
load of staged KV, from NVDEC, the ``lossless`` codec or DPU output ``kv``) and, for each codec with a
device dequant stage, a write of its codes (dequant, or for the transform codec its trellis replay when
the codec's quantizer is the trellis, then the inverse transform; + scatter: the linker's load of staged
codes, every path's on a GPU pool); for each codec with a device encode, the write-back's read of 16
tokens coded on the device (``encodes``; the write-back issues it on the scheduler thread). A load's
token window (a run that starts or ends inside a chunk) slices the same output before the same scatter:
no other variant. Triton specializes on dtypes, constexprs, 16-divisibility of integer arguments and 16-byte
alignment of pointers; the writer's token counts are multiples of 16 (chunk and tail sizes are) and its
staging offsets are 64-byte aligned, so one write of 16 tokens per kind reaches the same variants as any
real write. The writes go to scratch planes of the pool's row shape and dtype, never into the pool.

Then each kind of write is *timed* at a size where the device's bandwidth shows (``TIMED_TOKENS``: one
layer of a short chunk repeated; the median of ``TIMED_RUNS``): the decoded bytes per second of the
load on this device, which the policy adds to a fetch's estimate (``WarmUp.load_bps``), so its
fetch-vs-recompute decision uses the measured device decode, not a host rate.

Threads: the caller's (start-up); uses the writer's ops and side stream. Host pools compile nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sgl_remote_kv.codec.format import parse_header
from sgl_remote_kv.types import KVLayout, ModelFingerprint

from .device_writer import DeviceKVWriter
from .writer import TORCH_DTYPES, KVWriter, PoolTensors

logger = logging.getLogger(__name__)

TOKENS = 16  # a multiple of 16 like every real write: the same specializations
CHUNK_TOKENS, COPIES = 64, 64  # a timed write: one layer of a 64-token chunk, 64 times (4096 tokens)
TIMED_RUNS = 3


@dataclass(frozen=True)
class WarmUp:
    writes: tuple[str, ...]  # the kinds of write run (``kv``, ``codes:<codec>``)
    seconds: float
    load_bps: dict[str, float] = field(default_factory=dict)  # write kind -> decoded KV bytes per second
    encodes: tuple[str, ...] = ()  # the write-back's device encodes run (``encode:<codec>``)


def warm_up(writer: KVWriter, codecs: Sequence, fingerprint: ModelFingerprint) -> WarmUp:
    """See module docstring. Raises what a failing write raises (``KVWriteError``): a device that cannot
    run the writer's kernels should fail the start, not the first request."""
    if not isinstance(writer, DeviceKVWriter):
        return WarmUp((), 0.0)
    t0 = time.perf_counter()
    lay = writer.layout
    one = KVLayout(1, lay.num_kv_heads, lay.head_dim, lay.dtype)
    row_bytes = lay.num_kv_heads * lay.head_dim * writer.storage.itemsize
    planes = [
        writer.ops.device_empty(TOKENS * row_bytes)
        .view(TORCH_DTYPES[lay.dtype])
        .view(TOKENS, lay.num_kv_heads, lay.head_dim)
        for _ in "kv"
    ]
    scratch = DeviceKVWriter(PoolTensors([planes[0]], [planes[1]]), one, writer.ops, writer.timeout_s)
    scratch._consts = writer._consts  # the layers' transform constants stay uploaded for the real writer
    slots = torch.arange(TOKENS)
    k, v = _random_kv(lay, TOKENS)
    done = []
    scratch.write(k[:1], v[:1], slots)
    done.append("kv")
    codes = {}
    for codec in codecs:
        if not codec.device_dequant or f"codes:{codec.name}" in done:
            continue
        codes[codec.name] = _codes_view(codec, k, v, fingerprint)
        scratch.write_quantized([codes[codec.name]], slots, 0)
        done.append(f"codes:{codec.name}")
    encodes = []
    for codec in codecs:  # the write-back's device encode (its trellis search is a Triton kernel on a GPU)
        if getattr(codec, "device_encode", False) and f"encode:{codec.name}" not in encodes:
            spec = codec.device_encode_spec(fingerprint)
            scratch.read_quantized_later(slots, spec, TOKENS, 0).result()
            encodes.append(f"encode:{codec.name}")
    compiled = time.perf_counter() - t0
    rates = _timed(writer, one, k, v, codes, fingerprint, codecs)
    logger.debug("KV writer kernels compiled in %.2f s; load rates %s", compiled, rates)
    return WarmUp(tuple(done), time.perf_counter() - t0, rates, tuple(encodes))


def _codes_view(codec, k, v, fingerprint):
    blob = codec.encode(k, v, fingerprint)
    hdr = parse_header(blob, fingerprint)
    return codec.codes_stage(blob, hdr, 0, np.empty(codec.scratch_bytes(hdr, 0), np.uint8))


def _timed(writer: DeviceKVWriter, one: KVLayout, k, v, codes: dict, fingerprint, codecs) -> dict[str, float]:
    """Decoded bytes per second of each kind of write, at ``COPIES`` x ``CHUNK_TOKENS`` tokens of one
    layer into scratch planes of that size (never the pool)."""
    lay, n = writer.layout, CHUNK_TOKENS * COPIES
    planes = [
        writer.ops.device_empty(n * lay.num_kv_heads * lay.head_dim * writer.storage.itemsize)
        .view(TORCH_DTYPES[lay.dtype])
        .view(n, lay.num_kv_heads, lay.head_dim)
        for _ in "kv"
    ]
    scratch = DeviceKVWriter(PoolTensors([planes[0]], [planes[1]]), one, writer.ops, writer.timeout_s)
    scratch._consts = writer._consts
    slots = torch.arange(n)
    kc, vc = _random_kv(lay, CHUNK_TOKENS)
    kv_k, kv_v = np.concatenate([kc[:1]] * COPIES, axis=1), np.concatenate([vc[:1]] * COPIES, axis=1)
    runs = {"kv": lambda: scratch.write(kv_k, kv_v, slots)}
    for codec in codecs:
        if codec.name in codes:
            view = _codes_view(codec, kc, vc, fingerprint)
            runs[f"codes:{codec.name}"] = lambda view=view: scratch.write_quantized([view] * COPIES, slots, 0)
    out = {}
    for kind, run in runs.items():
        run()  # this size's first launch
        times = []
        for _ in range(TIMED_RUNS):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out[kind] = 2 * kv_k.nbytes / max(sorted(times)[TIMED_RUNS // 2], 1e-9)
    return out


def _random_kv(lay: KVLayout, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    f = rng.standard_normal((2, lay.num_layers, tokens, lay.num_kv_heads, lay.head_dim), np.float32)
    if lay.dtype == "bfloat16":
        f = (f.view(np.uint32) >> 16).astype(np.uint16)
    elif lay.dtype == "float16":
        f = f.astype(np.float16)
    return f[0], f[1]
