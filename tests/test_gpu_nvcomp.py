"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): would a GPU lossless stage pay (issue 50 item 7)?

The transform codec's layer sections hold three streams (``lz.pack_streams``): the prefix (prelude, scales,
escapes, sink tokens: small) and the K and V symbols (most of the bytes, most of the host's lossless stage),
raw Deflate (Huffman-only; ``dpu`` and ``auto`` write it) or zstd frames (``inproc``'s default). This
measures NVIDIA nvCOMP's batched decode (``nvidia-nvcomp-cu13``, ``BitstreamKind.RAW``: algorithm
``Deflate`` or ``Zstd``) of the symbol streams of Llama-3-8B-shaped chunks (synthetic KV, synthetic
calibration, the default trellis quantizer) against the host's decoder on one thread (ISA-L, zstd), in the
same run: the decoded bytes must be the host's, bit for bit, and the GPU report's ``metrics`` get both
rates (``nvcomp_<entropy>_gbps``, ``host_<entropy>_gbps_one_thread``). Nothing here asserts a speed; the read path
does not use nvCOMP (docs/INTEGRATION.md, Limits): this is the measurement that decides whether it should.
Skipped without CUDA, or naming ``nvidia`` when the wheel was not carried (``scripts/gpu_wheels.sh``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_needs("nvidia.nvcomp")]

CHUNK, CHUNKS, LAYERS = 256, 8, 8


def _symbol_streams(entropy: str) -> list[tuple[bytes, int]]:
    """(compressed body, decoded length) of every symbol stream of the chunks' sections coded with
    ``entropy`` (none is stored raw on this KV)."""
    from calibration_helpers import device_decode_codec

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec import lz
    from sgl_remote_kv.codec.format import layer_section

    fp = synthetic.fingerprint(num_layers=LAYERS, heads=8, dim=128)
    codec = device_decode_codec(
        {"deflate": "transform_trellis", "zstd": "transform_trellis_zstd"}[entropy], fp
    )
    method = lz.PACKED[entropy]
    out = []
    for i in range(CHUNKS):
        blob = codec.encode(*synthetic.kv(fp.layout, CHUNK, seed=i), fp, start=i * CHUNK)
        hdr = codec.parse(blob, fp)
        for layer in range(LAYERS):
            sec = bytes(layer_section(blob, hdr, layer))
            _, n, _, _ = lz.SUB.unpack_from(sec, 0)
            streams = [lz.STREAM.unpack_from(sec, lz.SUB.size + j * lz.STREAM.size) for j in range(n)]
            at = lz.SUB.size + n * lz.STREAM.size
            for j, (m, raw, comp) in enumerate(streams):
                if j > 0 and m == method:  # the symbol streams (stream 0: the prefix)
                    out.append((sec[at : at + comp], raw))
                at += comp
    return out


@pytest.mark.parametrize("entropy", ["deflate", "zstd"])
def test_nvcomp_decodes_the_transform_codec_s_symbol_streams_like_the_host(gpu_metrics, entropy):
    import zstandard
    from isal import isal_zlib
    from nvidia import nvcomp

    streams = _symbol_streams(entropy)
    assert len(streams) == 2 * CHUNKS * LAYERS
    raw_bytes = sum(r for _, r in streams)
    if entropy == "deflate":
        host = lambda body, r: isal_zlib.decompressobj(-15).decompress(body, r)  # noqa: E731
    else:
        zd = zstandard.ZstdDecompressor()
        host = lambda body, r: zd.decompress(body, max_output_size=r)  # noqa: E731
    want = [host(body, r) for body, r in streams]
    t0 = time.thread_time()
    for body, r in streams:
        host(body, r)
    host_s = time.thread_time() - t0

    algorithm = {"deflate": "Deflate", "zstd": "Zstd"}[entropy]
    codec = nvcomp.Codec(algorithm=algorithm, bitstream_kind=nvcomp.BitstreamKind.RAW)
    dev = [torch.frombuffer(bytearray(body), dtype=torch.uint8).cuda() for body, _ in streams]
    arrays = [nvcomp.as_array(t) for t in dev]
    got = codec.decode(arrays)  # first call: allocations, size queries
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert bytes(g.cpu()) == w  # bit for bit the host's decode
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        codec.decode(arrays)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gpu_metrics[f"nvcomp_{entropy}_gbps"] = round(raw_bytes / min(times) / 1e9, 2)
    gpu_metrics[f"host_{entropy}_gbps_one_thread"] = round(raw_bytes / host_s / 1e9, 3)
    gpu_metrics[f"nvcomp_{entropy}_streams"] = {
        "streams": len(streams),
        "inflated_bytes": raw_bytes,
        "mean_stream_bytes": int(np.mean([r for _, r in streams])),
        "what": f"K/V symbol streams of {CHUNKS} chunks x {LAYERS} layers, 256 tokens, 8 KV heads x 128, "
        "transform codec (trellis), synthetic KV",
    }
