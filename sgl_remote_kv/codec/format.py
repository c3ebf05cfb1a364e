"""The chunk blob: a struct-packed, self-describing, verified container (no pickle).

Layout (all integers little-endian)::

    fixed header  (FIXED, 88 bytes)
      magic        4s   b"SKVC"
      version      u16  FORMAT_VERSION
      flags        u16  0 (no flag is defined; a reader refuses unknown flags)
      codec_id     u16  registry id of the codec
      params_len   u16  length of the canonical codec-parameter bytes
      fingerprint  32s  ModelFingerprint.digest()
      num_layers   u32
      num_kv_heads u32
      head_dim     u32
      dtype        u8   index into types.KV_DTYPES (+3 pad bytes)
      num_tokens   u32
      header_len   u32  bytes of the whole header (fixed + params + layer table + crc)
      payload_len  u64  bytes of all layer sections together
      aux_id       16s  id of an external table the codec needs (entropy model), zeros if none
    params       params_len bytes, canonical JSON (sorted keys, no spaces)
    layer table  num_layers x (offset u64, length u64, crc32 u32), offsets relative to payload start,
                 sections contiguous and in layer order
    header_crc   u32  CRC32 of every header byte before it
    payload      the layer sections (codec-defined; each holds K and V of its layer incl. scales)

The header CRC covers the layer table, which holds each section's CRC, so header + payload are covered
and a streaming consumer can verify layer ``i`` as soon as its section arrived. ``parse_header`` checks
magic, version, limits, lengths and the header CRC before anything proportional to claimed sizes is
allocated. Authenticity is the store's job (``store/security.py``: the value is framed with an HMAC bound
to its chunk key when ``--remote-kv-auth-key-file`` is set); the blob itself carries checksums only.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from isal import isal_zlib

from sgl_remote_kv.codec.errors import CorruptChunk, ForeignChunk, LimitExceeded, UnsupportedVersion
from sgl_remote_kv.types import KV_DTYPES, KVLayout, ModelFingerprint

MAGIC = b"SKVC"
FORMAT_VERSION = 1
FIXED = struct.Struct("<4sHHHH32sIIIB3xIIQ16s")
LAYER_ENTRY = struct.Struct("<QQI")
CRC = struct.Struct("<I")
_NO_AUX = bytes(16)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "Limits",
    "DEFAULT_LIMITS",
    "LayerEntry",
    "ChunkHeader",
    "pack",
    "parse_header",
    "header_len",
    "layer_section",
    "canonical_params",
    "crc32",
]


def crc32(data, value: int = 0) -> int:
    """CRC32 (zlib polynomial) via isal; releases the GIL on large inputs."""
    return isal_zlib.crc32(data, value)


def canonical_params(params: dict) -> bytes:
    """Canonical byte form of codec parameters (sorted keys, compact separators, ASCII)."""
    return json.dumps(params, sort_keys=True, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a header may claim; checked before allocating anything."""

    max_tokens: int = 1 << 16
    max_layers: int = 1024
    max_kv_heads: int = 1024
    max_head_dim: int = 1024
    max_blob_bytes: int = 1 << 30
    max_decoded_bytes: int = 1 << 31  # K + V of the whole chunk in its KV dtype
    max_params_bytes: int = 4096


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class LayerEntry:
    offset: int  # absolute offset of the section in the blob
    length: int
    crc: int


@dataclass(frozen=True)
class ChunkShape:
    """What a codec's ``view`` reads of a chunk's header: its model layout and token count. A host that
    has only a chunk's lossless-stage output (the data plane wrote it, ``SubmitFetch.output`` codes)
    passes this; the view still checks the output's own prelude against it."""

    layout: KVLayout
    num_tokens: int


@dataclass(frozen=True)
class ChunkHeader:
    """Parsed, verified header. ``layers[i]`` locates layer ``i``'s section in the blob."""

    version: int
    flags: int
    codec_id: int
    params: bytes
    fingerprint_digest: bytes
    layout: KVLayout
    num_tokens: int
    aux_id: bytes
    header_len: int
    payload_len: int
    layers: tuple[LayerEntry, ...]

    @property
    def blob_len(self) -> int:
        return self.header_len + self.payload_len


def pack(
    codec_id: int,
    params: bytes,
    fingerprint: ModelFingerprint,
    num_tokens: int,
    sections: list,
    *,
    aux_id: bytes = _NO_AUX,
) -> bytes:
    """Assemble a blob from per-layer sections (bytes-like, one per layer, in order)."""
    layout = fingerprint.layout
    if len(sections) != layout.num_layers:
        raise ValueError(f"{len(sections)} sections for {layout.num_layers} layers")
    if len(aux_id) != 16:
        raise ValueError("aux_id must be 16 bytes")
    flags = 0
    header_len = FIXED.size + len(params) + layout.num_layers * LAYER_ENTRY.size + CRC.size
    payload_len = sum(len(s) for s in sections)
    parts = [
        FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            codec_id,
            len(params),
            fingerprint.digest(),
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            KV_DTYPES.index(layout.dtype),
            num_tokens,
            header_len,
            payload_len,
            aux_id,
        ),
        params,
    ]
    offset = 0
    for s in sections:
        parts.append(LAYER_ENTRY.pack(offset, len(s), crc32(s)))
        offset += len(s)
    head = b"".join(parts)
    out = bytearray(head)
    out += CRC.pack(crc32(head))
    for s in sections:
        out += s
    return bytes(out)


def _check_limits(fields: tuple, blob_len: int, limits: Limits) -> None:
    (_, _, _, _, params_len, _, nl, nh, hd, dt, nt, header_len, payload_len, _) = fields
    if params_len > limits.max_params_bytes:
        raise LimitExceeded(f"params {params_len} B > {limits.max_params_bytes}")
    if not 0 < nl <= limits.max_layers:
        raise LimitExceeded(f"num_layers {nl} outside (0, {limits.max_layers}]")
    if not 0 < nh <= limits.max_kv_heads:
        raise LimitExceeded(f"num_kv_heads {nh} outside (0, {limits.max_kv_heads}]")
    if not 0 < hd <= limits.max_head_dim:
        raise LimitExceeded(f"head_dim {hd} outside (0, {limits.max_head_dim}]")
    if dt >= len(KV_DTYPES):
        raise CorruptChunk(f"unknown dtype code {dt}")
    if not 0 < nt <= limits.max_tokens:
        raise LimitExceeded(f"num_tokens {nt} outside (0, {limits.max_tokens}]")
    itemsize = (4, 2, 2)[dt]
    if 2 * nl * nt * nh * hd * itemsize > limits.max_decoded_bytes:
        raise LimitExceeded("decoded size beyond max_decoded_bytes")
    if header_len + payload_len > limits.max_blob_bytes or blob_len > limits.max_blob_bytes:
        raise LimitExceeded("blob size beyond max_blob_bytes")
    if header_len != FIXED.size + params_len + nl * LAYER_ENTRY.size + CRC.size:
        raise CorruptChunk("inconsistent header_len")


def _read_layers(blob, base: int, nl: int, header_len: int, payload_len: int) -> tuple[LayerEntry, ...]:
    layers = []
    expect = 0
    for i in range(nl):
        off, length, crc = LAYER_ENTRY.unpack_from(blob, base + i * LAYER_ENTRY.size)
        if off != expect or length > payload_len - off:
            raise CorruptChunk(f"layer {i} section out of bounds")
        layers.append(LayerEntry(header_len + off, length, crc))
        expect = off + length
    if expect != payload_len:
        raise CorruptChunk("layer sections do not cover the payload")
    return tuple(layers)


def header_len(prefix) -> int | None:
    """The header length a blob's first bytes claim (``None`` before the fixed header is in): how many
    bytes a streaming reader needs before ``parse_header(..., complete=False)``. ``CorruptChunk`` on a bad
    magic; the length itself is checked by ``parse_header``."""
    if len(prefix) < FIXED.size:
        return None
    fields = FIXED.unpack_from(prefix, 0)
    if fields[0] != MAGIC:
        raise CorruptChunk("bad magic")
    return max(fields[11], FIXED.size)


def parse_header(
    blob,
    expected: ModelFingerprint | None,
    limits: Limits = DEFAULT_LIMITS,
    *,
    verify_payload: bool = True,
    complete: bool = True,
) -> ChunkHeader:
    """Parse and verify a blob's header (and, by default, every section's CRC).

    ``complete=False``: ``blob`` is the front of a blob still arriving (at least ``header_len`` bytes);
    the header is verified, the payload not (``layer_section(..., verify=True)`` each section once it
    is in). Raises only ``ChunkError`` subclasses. ``expected=None`` skips the fingerprint check (tools only).
    """
    blob = memoryview(blob).cast("B") if not isinstance(blob, bytes | bytearray) else blob
    n = len(blob)
    if n < FIXED.size:
        raise CorruptChunk(f"blob of {n} bytes is shorter than the fixed header")
    fields = FIXED.unpack_from(blob, 0)
    magic, version, flags = fields[0], fields[1], fields[2]
    if magic != MAGIC:
        raise CorruptChunk("bad magic")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"format version {version}, this build reads {FORMAT_VERSION}")
    if flags:
        raise CorruptChunk(f"unknown flags {flags:#x}")
    (_, _, _, codec_id, params_len, digest, nl, nh, hd, dt, nt, header_len, payload_len, aux) = fields
    total = header_len + payload_len
    _check_limits(fields, total if not complete else n, limits)
    if complete and n != total:
        raise CorruptChunk(f"blob is {n} bytes, header claims {total}")
    if not complete:
        if n < header_len:
            raise CorruptChunk(f"{n} bytes hold no whole header of {header_len}")
        verify_payload = False
    (hcrc,) = CRC.unpack_from(blob, header_len - CRC.size)
    if crc32(blob[: header_len - CRC.size]) != hcrc:
        raise CorruptChunk("header checksum mismatch")
    params = bytes(blob[FIXED.size : FIXED.size + params_len])
    layers = _read_layers(blob, FIXED.size + params_len, nl, header_len, payload_len)
    layout = KVLayout(nl, nh, hd, KV_DTYPES[dt])
    if expected is not None and (digest != expected.digest() or layout != expected.layout):
        raise ForeignChunk("chunk belongs to another model fingerprint")
    hdr = ChunkHeader(
        version, flags, codec_id, params, digest, layout, nt, aux, header_len, payload_len, layers
    )
    if verify_payload:
        for i in range(nl):
            layer_section(blob, hdr, i, verify=True)
    return hdr


def layer_section(blob, header: ChunkHeader, layer: int, *, verify: bool = False) -> memoryview:
    """Zero-copy view of layer ``layer``'s section; ``verify`` checks its CRC (CorruptChunk)."""
    if not 0 <= layer < len(header.layers):
        raise CorruptChunk(f"no layer {layer}")
    e = header.layers[layer]
    view = memoryview(blob)[e.offset : e.offset + e.length]
    if len(view) != e.length:
        raise CorruptChunk(f"layer {layer} section truncated")
    if verify and crc32(view) != e.crc:
        raise CorruptChunk(f"layer {layer} checksum mismatch")
    return view
