"""The ``hevc`` codec: quantized KV in KVFetcher's video layout, coded with lossless HEVC.

A regular chunk blob (``sgl_remote_kv.codec.format``, codec id :data:`CODEC_ID`). Quantization is the
shared ``quant`` module (same bins/granularity/channel scales as ``quant_deflate``), so for equal quant
parameters the decoded KV is bit-identical to ``quant_deflate``'s: only the lossless back-end differs.

Sections: layers are coded in groups of three (one video each for K and V, the layers on the Y/U/V
planes). The section of a group's first layer holds the whole group; the other two sections are empty::

    <4sBBHIII  magic b"HVG1", layers in group (1..3), 0, 0, frames, height, width
    <II        side bytes (deflated), side raw length
    side       per layer: <I length + the quant buffer without its codes (prelude, scales, channel scales)
    K video    <I packet count, <I per packet length, packet bytes   (Annex-B, headers in-band)
    V video    same

Decoding has two entry points: the ABC's stage split (``lossless_stage`` rebuilds the group's quant
buffers, ``dequant_stage`` dequantizes one layer) used by ``decode``/``decode_layers``, and
:meth:`HevcCodec.iter_frames`, the frame-wise path of the decoder pool (one :class:`FrameCodes` per decoded
frame, never a whole chunk). Codec instances are immutable; decoders are passed in per thread.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from sgl_remote_kv.nvdec import layout as lo
from sgl_remote_kv.nvdec.video import MAX_SIDE, VideoDecoder, encode_planes

from sgl_remote_kv.codec import quant
from sgl_remote_kv.codec.base import Codec, check_chunk_arrays
from sgl_remote_kv.codec.errors import CorruptChunk, ForeignChunk
from sgl_remote_kv.codec.format import ChunkHeader, layer_section
from sgl_remote_kv.types import ModelFingerprint, numpy_storage_dtype

CODEC_ID = 5
GROUP = 3
SEC = struct.Struct("<4sBBHIII")
SIDE = struct.Struct("<II")
U32 = struct.Struct("<I")
MAGIC = b"HVG1"


@dataclass(frozen=True)
class LayerSide:
    """Dequantization parameters of one layer (float32 copies, owned by the caller)."""

    mk: int
    mv: int
    k_scales: np.ndarray  # [T, G]
    v_scales: np.ndarray
    k_cs: np.ndarray  # [H*D] or empty


@dataclass(frozen=True)
class FrameCodes:
    """One decoded frame: the codes of ``tokens`` for ``layers`` of K (``kind="k"``) or V.

    ``codes`` ``[len(layers), n, H*D]`` uint8 is a fresh array the receiver may keep or drop.
    """

    kind: str
    layers: tuple[int, ...]
    tokens: np.ndarray
    codes: np.ndarray
    sides: tuple[LayerSide, ...]


@dataclass(frozen=True)
class GroupSection:
    """A parsed group section (views into the blob)."""

    n_layers: int
    frames: int
    height: int
    width: int
    side: bytes
    videos: tuple[list[memoryview], list[memoryview]]


class HevcCodec(Codec):
    """Lossless HEVC over quantized codes. ``device``/``preset`` only affect encoding (not params)."""

    name = "hevc"
    codec_id = CODEC_ID
    sub_chunks = False  # the frame layout is fixed by the chunk size

    def __init__(
        self,
        k_bins="256",
        v_bins="256",
        granularity="head",
        k_channel_scale=False,
        tiling="1x3/8x8",
        tokens_per_frame=0,
        grid_cols=0,
        min_side=lo.NVENC_MIN_SIDE,
        *,
        device="cpu",
        preset="fast",
    ):
        self.spec = quant.QuantSpec.make(k_bins, v_bins, granularity, k_channel_scale)
        self.tiling = lo.Tiling.parse(str(tiling))
        self.tokens_per_frame, self.grid_cols, self.min_side = (
            int(tokens_per_frame),
            int(grid_cols),
            int(min_side),
        )
        if min(self.tokens_per_frame, self.grid_cols, self.min_side) < 0:
            raise ValueError("tokens_per_frame, grid_cols and min_side must be >= 0")
        self.device, self.preset = device, preset

    def params(self) -> dict:
        return {
            **self.spec.params(),
            "tiling": self.tiling.spec(),
            "tokens_per_frame": self.tokens_per_frame,
            "grid_cols": self.grid_cols,
            "min_side": self.min_side,
        }

    def frame_layout(self, tokens: int, heads: int, dim: int) -> lo.FrameLayout:
        return lo.FrameLayout(
            heads, dim, tokens, self.tiling, self.tokens_per_frame, self.grid_cols, self.min_side
        )

    # ---- encode ---------------------------------------------------------------------------------
    def encode_layer(self, k, v, layer, fingerprint):
        raise NotImplementedError("hevc codes three layers per video; use encode()")

    def encode(self, k, v, fingerprint: ModelFingerprint, start: int = 0) -> bytes:
        """Encode a chunk (``[L, T, H, D]`` storage dtype). Called by the encoding thread."""
        from sgl_remote_kv.codec.format import pack

        lay = fingerprint.layout
        check_chunk_arrays(k, v, lay)
        sections: list[bytes] = []
        for g in range(0, lay.num_layers, GROUP):
            layers = range(g, min(g + GROUP, lay.num_layers))
            sections.append(self._encode_group(k, v, layers, lay.dtype))
            sections += [b""] * (len(layers) - 1)
        return pack(self.codec_id, self.params_bytes(), fingerprint, k.shape[1], sections)

    def _encode_group(self, k, v, layers: range, dtype: str) -> bytes:
        t, h, d = k.shape[1:]
        fl = self.frame_layout(t, h, d)
        c = h * d
        sides, k_codes, v_codes = [], [], []
        for i in layers:
            buf = quant.quantize_layer(self.spec, k[i], v[i], i, dtype)
            side_len = buf.size - 2 * t * c
            sides.append(U32.pack(side_len) + buf[:side_len].tobytes())
            k_codes.append(buf[side_len : side_len + t * c].reshape(t, c))
            v_codes.append(buf[side_len + t * c :].reshape(t, c))
        side = b"".join(sides)
        hh, ww = fl.size
        out = [SEC.pack(MAGIC, len(layers), 0, 0, fl.frames, hh, ww)]
        zside = zlib.compress(side, 6)
        out += [SIDE.pack(len(zside), len(side)), zside]
        for codes in (k_codes, v_codes):
            packets = encode_planes(lo.group_planes(codes, fl), self.device, self.preset)
            out += [U32.pack(len(packets)), *(U32.pack(len(p)) for p in packets), *packets]
        return b"".join(out)

    # ---- parsing --------------------------------------------------------------------------------
    def parse_group(self, section: memoryview, fl: lo.FrameLayout | None = None) -> GroupSection:
        """Parse a group section; with ``fl`` also check its geometry. Raises ``CorruptChunk``."""
        try:
            magic, nl, _, _, frames, hh, ww = SEC.unpack_from(section, 0)
            zlen, raw_len = SIDE.unpack_from(section, SEC.size)
        except struct.error:
            raise CorruptChunk("hevc group section truncated") from None
        if magic != MAGIC or not 1 <= nl <= GROUP:
            raise CorruptChunk("bad hevc group section header")
        if fl is not None and (frames, (hh, ww)) != (fl.frames, fl.size):
            raise CorruptChunk(f"group geometry {frames}x{hh}x{ww} does not match the codec's layout")
        o = SEC.size + SIDE.size
        zside = bytes(section[o : o + zlen])
        o += zlen
        try:
            d = zlib.decompressobj()
            side = d.decompress(zside, raw_len + 1)
        except zlib.error:
            raise CorruptChunk("hevc side info does not inflate") from None
        if len(side) != raw_len or len(zside) != zlen:
            raise CorruptChunk("hevc side info length mismatch")
        videos = []
        for _ in range(2):
            packets, o = _read_packets(section, o, frames)
            videos.append(packets)
        if o != len(section):
            raise CorruptChunk("trailing bytes in hevc group section")
        return GroupSection(nl, frames, hh, ww, side, (videos[0], videos[1]))

    def layer_sides(self, gs: GroupSection, first: int, t: int, h: int, d: int) -> list[LayerSide]:
        """Validate and unpack each layer's side info (via ``quant.split_layer``)."""
        out, o = [], 0
        for j in range(gs.n_layers):
            if o + U32.size > len(gs.side):
                raise CorruptChunk("hevc side info truncated")
            (n,) = U32.unpack_from(gs.side, o)
            chunk = np.frombuffer(
                gs.side, np.uint8, count=min(n, len(gs.side) - o - U32.size), offset=o + U32.size
            )
            o += U32.size + n
            buf = np.concatenate([chunk, np.zeros(2 * t * h * d, np.uint8)])
            view = quant.split_layer(self.spec, buf, first + j, t, h, d)
            cs = view.k_cs.astype(np.float32) if view.k_cs.size else np.empty(0, np.float32)
            out.append(
                LayerSide(
                    view.mk, view.mv, view.k_scales.astype(np.float32), view.v_scales.astype(np.float32), cs
                )
            )
        if o != len(gs.side):
            raise CorruptChunk("hevc side info length mismatch")
        return out

    def _group(
        self, blob, header: ChunkHeader, first: int
    ) -> tuple[GroupSection, list[LayerSide], lo.FrameLayout]:
        lay = header.layout
        nl = min(GROUP, lay.num_layers - first)
        for j in range(1, nl):
            if header.layers[first + j].length:
                raise CorruptChunk(f"layer {first + j} section of an hevc group must be empty")
        try:
            fl = self._layout_codec(header).frame_layout(header.num_tokens, lay.num_kv_heads, lay.head_dim)
        except ValueError as e:  # e.g. a tiling for another head count
            raise CorruptChunk(f"hevc layout: {e}") from None
        check_geometry(fl)
        gs = self.parse_group(layer_section(blob, header, first), fl)
        if gs.n_layers != nl:
            raise CorruptChunk("hevc group layer count mismatch")
        return gs, self.layer_sides(gs, first, header.num_tokens, lay.num_kv_heads, lay.head_dim), fl

    def _layout_codec(self, header: ChunkHeader) -> HevcCodec:
        """The codec whose frame layout ``header``'s chunk uses: this one, or a *version* of it (same
        quantization and tiling, another ``tokens_per_frame``: adaptive resolution, ``adapter.py``), whose
        codes dequantize exactly like this codec's. Any other params: ``ForeignChunk``."""
        if header.params == self.params_bytes():
            return self
        try:
            params = json.loads(header.params)
            other = HevcCodec(**params) if isinstance(params, dict) else None
        except (ValueError, TypeError):
            other = None
        mine = self.params()
        if (
            other is None
            or other.params_bytes() != header.params
            or {k: v for k, v in other.params().items() if k != "tokens_per_frame"}
            != {k: v for k, v in mine.items() if k != "tokens_per_frame"}
        ):
            raise ForeignChunk("hevc chunk of another quantization or tiling")
        return other

    # ---- frame-wise decode (the pool's path) ---------------------------------------------------------
    def iter_frames(self, blob, header: ChunkHeader, decoder: VideoDecoder) -> Iterator[FrameCodes]:
        """Yield every decoded frame of a parsed chunk, group by group, K video then V video.

        Called on a pool worker thread that owns ``decoder``. Raises only ``CorruptChunk``.
        """
        for first in range(0, header.layout.num_layers, GROUP):
            gs, sides, fl = self._group(blob, header, first)
            layers = tuple(range(first, first + gs.n_layers))
            for kind, packets in zip("kv", gs.videos, strict=True):
                for f, planes in enumerate(decoder.frames(packets, fl.frames, fl.size[0], fl.size[1])):
                    codes = np.stack([lo.from_frame(fl, planes[j], f) for j in range(gs.n_layers)])
                    yield FrameCodes(kind, layers, fl.frame_tokens(f), codes, tuple(sides))

    # ---- the ABC's stage split -----------------------------------------------------------------
    def scratch_bytes(self, header: ChunkHeader, layer: int) -> int:
        lay = header.layout
        one = quant.max_decoded_bytes(self.spec, header.num_tokens, lay.num_kv_heads, lay.head_dim)
        return U32.size * GROUP + GROUP * one

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        raise NotImplementedError("hevc sections need the chunk header; use decode_layer_into()")

    def decode_layer_into(self, blob, header, layer, scratch, out_k, out_v) -> None:
        """Decode ``layer``'s group into ``scratch`` (all three layers' quant buffers), then dequantize."""
        first = layer - layer % GROUP
        n = self._group_buffers(blob, header, first, scratch, VideoDecoder("cpu"))
        self.dequant_stage(header, layer, scratch[:n], out_k, out_v)

    def _group_buffers(self, blob, header, first: int, out: np.ndarray, decoder: VideoDecoder) -> int:
        """Rebuild the group's per-layer quant buffers into ``out``: ``<III`` lengths then buffers."""
        lay = header.layout
        t, c = header.num_tokens, lay.num_kv_heads * lay.head_dim
        gs, _, fl = self._group(blob, header, first)
        if out.size < self.scratch_bytes(header, first):
            raise ValueError("scratch too small")
        lens, o, pos = [0] * GROUP, 0, U32.size * GROUP
        starts = []
        for j in range(gs.n_layers):
            (n,) = U32.unpack_from(gs.side, o)
            lens[j] = n + 2 * t * c
            out[pos : pos + n] = np.frombuffer(gs.side, np.uint8, count=n, offset=o + U32.size)
            starts.append(pos + n)
            o, pos = o + U32.size + n, pos + lens[j]
        for vi, packets in enumerate(gs.videos):
            for f, planes in enumerate(decoder.frames(packets, fl.frames, fl.size[0], fl.size[1])):
                tok = fl.frame_tokens(f)
                for j in range(gs.n_layers):
                    rows = out[starts[j] + vi * t * c : starts[j] + (vi + 1) * t * c].reshape(t, c)
                    rows[tok] = lo.from_frame(fl, planes[j], f)
        out[: U32.size * GROUP] = np.frombuffer(struct.pack("<III", *lens), np.uint8)
        return pos

    def dequant_stage(self, header, layer, decoded, out_k, out_v) -> None:
        self._check_out(header, out_k, out_v)
        lay = header.layout
        buf = np.asarray(decoded, dtype=np.uint8)
        if buf.size < U32.size * GROUP:
            raise CorruptChunk("hevc group buffer truncated")
        lens = struct.unpack_from("<III", buf, 0)
        j = layer % GROUP
        start = U32.size * GROUP + sum(lens[:j])
        if start + lens[j] > buf.size:
            raise CorruptChunk("hevc group buffer truncated")
        view = quant.split_layer(
            self.spec, buf[start : start + lens[j]], layer, header.num_tokens, lay.num_kv_heads, lay.head_dim
        )
        quant.dequant_layer(view, lay.dtype, out_k, out_v)

    def decode(self, blob, fingerprint, limits=None, *, decoder=None):
        """Whole-chunk decode (tests, benchmarks); each group's videos are decoded once."""
        from sgl_remote_kv.codec.format import DEFAULT_LIMITS

        hdr = self.parse(blob, fingerprint, limits or DEFAULT_LIMITS)
        lay = hdr.layout
        dt = numpy_storage_dtype(lay.dtype)
        shape = (lay.num_layers, hdr.num_tokens, lay.num_kv_heads, lay.head_dim)
        k, v = np.empty(shape, dt), np.empty(shape, dt)
        scratch = np.empty(self.scratch_bytes(hdr, 0), np.uint8)
        dec = decoder or VideoDecoder("cpu")
        for first in range(0, lay.num_layers, GROUP):
            n = self._group_buffers(blob, hdr, first, scratch, dec)
            for i in range(first, min(first + GROUP, lay.num_layers)):
                self.dequant_stage(hdr, i, scratch[:n], k[i], v[i])
        return k, v

    def decode_layers(self, blob, fingerprint, limits=None):
        k, v = self.decode(blob, fingerprint, limits)
        for i in range(k.shape[0]):
            yield i, k[i], v[i]


def check_geometry(fl: lo.FrameLayout) -> None:
    """Refuse frames the decoder cannot take or that are far larger than the chunk's codes need.

    The frame size derives from the header's token count and codec params (``min_side``,
    ``grid_cols``, ``tokens_per_frame``), which a hostile blob chooses: without this bound it could
    make every decoded frame up to ``MAX_SIDE`` squared. An honest layout's frame holds at most
    about twice its codes (grid rounding) or is one ``NVENC_MIN_SIDE`` square; 4x is the bound.
    """
    h, w = fl.size
    need = fl.slots * fl.heads * fl.dim
    if max(h, w) > MAX_SIDE or h * w > max(lo.NVENC_MIN_SIDE**2, 4 * need):
        raise CorruptChunk(f"hevc frame {w}x{h} for {fl.slots} token slots of {fl.heads}x{fl.dim} codes")


def _read_packets(section: memoryview, o: int, frames: int) -> tuple[list[memoryview], int]:
    try:
        (n,) = U32.unpack_from(section, o)
        if n > 4 * frames + 4:
            raise CorruptChunk(f"{n} packets for {frames} frames")
        lens = struct.unpack_from(f"<{n}I", section, o + U32.size)
    except struct.error:
        raise CorruptChunk("hevc packet table truncated") from None
    o += U32.size * (n + 1)
    packets = []
    for ln in lens:
        if ln == 0 or o + ln > len(section):
            raise CorruptChunk("hevc packet out of bounds")
        packets.append(section[o : o + ln])
        o += ln
    return packets, o
