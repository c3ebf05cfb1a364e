"""Per-model entropy tables for ``quant_rans``: one code distribution per (layer, K/V, channel).

Fitted once per (model fingerprint, quantization spec) from sample KV, saved once (``.npz`` of plain
arrays + JSON metadata, loaded with ``allow_pickle=False``), and referenced from every blob by a
16-byte ``table_id`` (BLAKE2b-128 over fingerprint digest, spec and frequencies). A decoder that does
not know a blob's table id raises ``ForeignChunk``.

Process-wide registry (``registry.Registry``): ``register`` / ``unregister`` / ``lookup`` / ``find_for``; ``load_dir`` registers every table file
in a directory (default ``<cache>/codec_tables``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sgl_remote_kv.codec import quant, rans
from sgl_remote_kv.codec.calibration.registry import Registry
from sgl_remote_kv.types import ModelFingerprint

MAX_SYMBOLS = 256


@dataclass(frozen=True)
class EntropyTables:
    """``freq[layer, kv, channel, symbol]`` (uint16, rows sum to 2^prob_bits)."""

    fingerprint_digest: bytes
    spec_params: str  # canonical JSON of the QuantSpec params
    prob_bits: int
    freq: np.ndarray
    table_id: bytes = field(default=b"", compare=False)
    _cum: np.ndarray = field(default=None, repr=False, compare=False)
    _cum16: np.ndarray = field(default=None, repr=False, compare=False)
    _bucket: np.ndarray = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        freq = np.ascontiguousarray(self.freq, np.uint16)
        if freq.ndim != 4 or freq.shape[1] != 2 or freq.shape[3] != MAX_SYMBOLS:
            raise ValueError(f"freq must be [layers, 2, channels, {MAX_SYMBOLS}], got {freq.shape}")
        freq.setflags(write=False)
        flat = freq.reshape(-1, MAX_SYMBOLS)
        cum, ok = rans.build_cum(flat, self.prob_bits)
        cum16, bucket, ok2 = rans.build_decode_tables(flat, self.prob_bits)
        if not (ok and ok2):
            raise ValueError("frequencies do not sum to 2^prob_bits")
        object.__setattr__(self, "freq", freq)
        object.__setattr__(self, "_cum", cum)
        object.__setattr__(self, "_cum16", cum16)
        object.__setattr__(self, "_bucket", bucket)
        object.__setattr__(self, "table_id", self.compute_id())

    def compute_id(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.fingerprint_digest)
        h.update(self.spec_params.encode())
        h.update(np.int64(self.prob_bits).tobytes())
        h.update(np.asarray(self.freq.shape, np.int64).tobytes())
        h.update(self.freq.tobytes())
        return h.digest()

    @property
    def num_layers(self) -> int:
        return self.freq.shape[0]

    @property
    def channels(self) -> int:
        return self.freq.shape[2]

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """Encoder tables (freq [N, S], cum [N, S+1] uint32); context of (layer, kv, c) is
        ``(layer * 2 + kv) * channels + c``."""
        return self.freq.reshape(-1, MAX_SYMBOLS), self._cum

    def decode_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Decoder tables (cum16 [N, S+1], bucket [N, 2^bits / 16]) from ``rans.build_decode_tables``."""
        return self._cum16, self._bucket

    def ctx0(self, layer: int, kv: int) -> int:
        return (layer * 2 + kv) * self.channels

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        meta = {
            "fingerprint_digest": self.fingerprint_digest.hex(),
            "spec_params": self.spec_params,
            "prob_bits": self.prob_bits,
            "table_id": self.table_id.hex(),
        }
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, freq=self.freq, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> EntropyTables:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
            freq = z["freq"]
        t = cls(bytes.fromhex(meta["fingerprint_digest"]), meta["spec_params"], int(meta["prob_bits"]), freq)
        if t.table_id.hex() != meta["table_id"]:
            raise ValueError(f"{path}: table id mismatch (file corrupted?)")
        return t


def fit(
    spec: quant.QuantSpec,
    fingerprint: ModelFingerprint,
    samples: list[tuple[np.ndarray, np.ndarray]],
    *,
    prob_bits: int = rans.PROB_BITS,
    smoothing: float = 0.5,
) -> EntropyTables:
    """Fit tables from sample KV chunks (each ``(k, v)`` in ``[L, T, H, D]`` storage dtype).

    ``smoothing`` is added to the count of every symbol of the layer's alphabet so codes never seen in
    the samples stay encodable.
    """
    lay = fingerprint.layout
    c = lay.num_kv_heads * lay.head_dim
    counts = np.zeros((lay.num_layers, 2, c, MAX_SYMBOLS), np.float64)
    offs = (np.arange(c) * MAX_SYMBOLS)[None, :]
    for k, v in samples:
        for layer in range(lay.num_layers):
            buf = quant.quantize_layer(spec, k[layer], v[layer], layer, lay.dtype)
            view = quant.split_layer(
                spec, buf, layer, k.shape[1], lay.num_kv_heads, lay.head_dim, lay.itemsize
            )
            for kv, codes in enumerate((view.k_codes, view.v_codes)):
                idx = (codes.astype(np.int64) + offs).ravel()
                counts[layer, kv] += np.bincount(idx, minlength=c * MAX_SYMBOLS).reshape(c, MAX_SYMBOLS)
    for layer in range(lay.num_layers):
        for kv, m in enumerate(spec.levels(layer)):
            counts[layer, kv, :, : 2 * m + 1] += smoothing
    freq = rans.normalize_counts(counts.reshape(-1, MAX_SYMBOLS), prob_bits).reshape(counts.shape)
    params = json.dumps(spec.params(), sort_keys=True, separators=(",", ":"))
    return EntropyTables(fingerprint.digest(), params, prob_bits, freq)


# ---- registry (``registry.Registry``: ``<cache>/codec_tables/<id>.npz``) -----------------------------
_REGISTRY: Registry[EntropyTables] = Registry(
    "entropy tables",
    "codec_tables",
    EntropyTables.load,
    lambda t: t.table_id,
    (OSError, ValueError, KeyError),
)
default_dir = _REGISTRY.default_dir
register = _REGISTRY.register
unregister = _REGISTRY.unregister
load_dir = _REGISTRY.load_dir
lookup = _REGISTRY.get  # by full 16-byte id, or by a unique 8-byte prefix


def find_for(fingerprint_digest: bytes, spec_params: str) -> EntropyTables | None:
    """The most recently registered table for this model and quantization spec."""
    hits = [
        t
        for t in _REGISTRY.items()
        if (t.fingerprint_digest, t.spec_params) == (fingerprint_digest, spec_params)
    ]
    return hits[-1] if hits else None
