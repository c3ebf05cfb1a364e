"""The per-model calibration of the ``transform`` codec: what is fitted once and never shipped per chunk.

A ``Calibration`` holds, per (layer, K/V, head group): the mean and an orthonormal basis (PCA of the
position-free KV: keys with RoPE undone, all heads of the group's channels together), and per quality
level the quantization step of every component (a factor of the token's RMS) plus the rANS frequencies
of the symbols those steps produce. A head group is a run of consecutive KV heads transformed together
(all of a layer's heads: the best decorrelation; one head: a third of the decode's matmul work); a TP
rank uses the groups of its heads, so a calibration serves every TP size whose ranks hold whole groups. It is bound to one model (``model_key``: architecture, weights identity, layer
count, total KV heads, head dim), records the RoPE it undid, and how many leading sequence positions
(``sinks``: attention sinks, badly served by a per-token scale) chunks store exactly. Fitting it needs the model (``python -m sgl_remote_kv.codec.calibration``, ``cli.py``); this module only
stores, verifies and looks it up (numpy only).

Content-addressed: ``calib_id`` is BLAKE2b-128 over every array and field; ``load`` refuses a file whose
content does not hash to the id it claims. Files are ``.npz`` of plain arrays + a JSON string, loaded
with ``allow_pickle=False``, named ``<id>.npz`` under ``default_dir()``.

Quality levels are a closed set of KL targets (``LEVELS``, nats of next-token KL against recomputation
on the calibration texts); a calibration serves the levels it was fitted for.

Thread-safety: ``Calibration`` is immutable (arrays read-only); the registry and the lazily built rANS
decode tables are lock-protected.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sgl_remote_kv.codec import rans
from sgl_remote_kv.codec.calibration.registry import Registry
from sgl_remote_kv.types import DEFAULT_QUALITY, QUALITY_LEVELS, ModelFingerprint, RopeSpec

LEVELS, DEFAULT_LEVEL = QUALITY_LEVELS, DEFAULT_QUALITY
SYMBOLS = 256
FORMAT = 1


class CalibrationError(ValueError):
    """A calibration is missing, foreign to this model, corrupt, or lacks the asked-for level."""


def model_key(fp: ModelFingerprint) -> bytes:
    """What a calibration is bound to: the model, not the KV dtype or the TP rank (a rank uses its head
    group, ``group_of``)."""
    lay = fp.layout
    ident = [
        FORMAT,
        fp.architecture,
        fp.weights_id,
        lay.num_layers,
        lay.num_kv_heads * fp.tp_size,
        lay.head_dim,
    ]
    return hashlib.sha256(b"sgl-remote-kv/calibration\x00" + json.dumps(ident).encode()).digest()


def group_of(fp: ModelFingerprint, groups: int, group_dim: int) -> int:
    """The first head group of ``fp``'s rank in a calibration of ``groups`` groups of ``group_dim``
    channels (the rank holds ``num_kv_heads * head_dim / group_dim`` consecutive groups)."""
    lay = fp.layout
    rank = lay.num_kv_heads * lay.head_dim
    if rank * fp.tp_size != groups * group_dim or rank % group_dim:
        raise CalibrationError(
            f"a calibration of {groups} head groups x {group_dim} channels does not fit TP {fp.tp_size} with "
            f"{lay.num_kv_heads} KV heads per rank: run `python -m sgl_remote_kv.codec.calibration --tp {fp.tp_size}`"
        )
    return fp.tp_rank * (rank // group_dim)


@dataclass(frozen=True)
class Calibration:
    model_key: bytes
    rope: RopeSpec
    mean: np.ndarray  # [L, 2, G, C] float32 (position-free domain; G groups of C = heads x head_dim channels)
    basis: np.ndarray  # [L, 2, G, C, C] float32; basis[l, kv, g][:, c] is component c (descending variance)
    steps: dict  # level -> [L, 2, G, C] float32 step of each component, in units of the token's RMS
    freq: dict  # level -> [L, 2, G * C, SYMBOLS] uint16 rANS frequencies (rows sum to 2^PROB_BITS)
    report: str = "{}"  # JSON: how it was fitted (texts, measured KL per level); covered by the id
    sinks: int = 1  # sequence positions [0, sinks) are stored exactly
    prob_bits: int = rans.PROB_BITS
    calib_id: bytes = field(default=b"", compare=False)
    _decode: dict = field(default_factory=dict, repr=False, compare=False)
    _encode: dict = field(default_factory=dict, repr=False, compare=False)
    _inverse: dict = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        mean = np.ascontiguousarray(self.mean, np.float32)
        basis = np.ascontiguousarray(self.basis, np.float32)
        if mean.ndim != 4 or mean.shape[1] != 2:
            raise CalibrationError(f"mean must be [L, 2, G, C], got {mean.shape}")
        n_l, _, n_h, d = mean.shape
        if basis.shape != (n_l, 2, n_h, d, d):
            raise CalibrationError(f"basis {basis.shape} does not match mean {mean.shape}")
        if len(self.model_key) != 32 or set(self.steps) != set(self.freq) or not self.steps:
            raise CalibrationError("bad model key or level tables")
        if not set(self.steps) <= set(LEVELS):
            raise CalibrationError(f"unknown levels {sorted(set(self.steps) - set(LEVELS))}")
        if d % self.rope.rotary_dim or not 0 <= self.sinks <= 64:
            raise CalibrationError(f"rotary dim {self.rope.rotary_dim} does not divide {d}, or bad sinks")
        steps, freq = {}, {}
        for lv in sorted(self.steps):
            s = np.ascontiguousarray(self.steps[lv], np.float32)
            f = np.ascontiguousarray(self.freq[lv], np.uint16)
            if s.shape != mean.shape or not np.all(np.isfinite(s)) or not np.all(s > 0):
                raise CalibrationError(f"level {lv}: steps must be positive, shaped {mean.shape}")
            if f.shape != (n_l, 2, n_h * d, SYMBOLS):
                raise CalibrationError(f"level {lv}: freq {f.shape} != {(n_l, 2, n_h * d, SYMBOLS)}")
            if np.any(f.reshape(-1, SYMBOLS).astype(np.int64).sum(1) != 1 << self.prob_bits):
                raise CalibrationError(f"level {lv}: frequencies do not sum to 2^{self.prob_bits}")
            steps[lv], freq[lv] = s, f
        for a in (mean, basis, *steps.values(), *freq.values()):
            a.setflags(write=False)
        for name, val in (("mean", mean), ("basis", basis), ("steps", steps), ("freq", freq)):
            object.__setattr__(self, name, val)
        object.__setattr__(self, "calib_id", self.compute_id())

    @property
    def num_layers(self) -> int:
        return self.mean.shape[0]

    @property
    def groups(self) -> int:
        return self.mean.shape[2]

    @property
    def group_dim(self) -> int:
        return self.mean.shape[3]

    @property
    def head_dim(self) -> int:
        return self.rope.rotary_dim

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(lv for lv in LEVELS if lv in self.steps)

    def compute_id(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.model_key + self.rope.canonical().encode() + self.report.encode())
        h.update(np.asarray([self.prob_bits, self.sinks], np.int64).tobytes())
        for a in (self.mean, self.basis):
            h.update(np.asarray(a.shape, np.int64).tobytes() + a.tobytes())
        for lv in sorted(self.steps):
            h.update(lv.encode() + self.steps[lv].tobytes() + self.freq[lv].tobytes())
        return h.digest()

    def check_level(self, level: str) -> None:
        if level not in self.steps:
            raise CalibrationError(
                f"calibration {self.calib_id.hex()} has no level {level} (has {self.levels})"
            )

    def encode_tables(self, level: str) -> tuple[np.ndarray, np.ndarray]:
        """(freq [N, S], cum [N, S+1]) for ``rans.encode``; context of (layer, kv, channel c of all heads)
        is ``((layer * 2 + kv) * G + group) * C + c``."""
        with self._lock:
            t = self._encode.get(level)
            if t is None:
                flat = self.freq[level].reshape(-1, SYMBOLS)
                cum, ok = rans.build_cum(flat, self.prob_bits)
                if not ok:
                    raise CalibrationError("bad frequency table")
                t = self._encode[level] = (flat, cum)
            return t

    def decode_tables(self, level: str) -> tuple[np.ndarray, np.ndarray]:
        """(cum16, bucket) for ``rans.decode``, built on first use per level."""
        with self._lock:
            t = self._decode.get(level)
            if t is None:
                cum16, bucket, ok = rans.build_decode_tables(
                    self.freq[level].reshape(-1, SYMBOLS), self.prob_bits
                )
                if not ok:
                    raise CalibrationError("bad frequency table")
                t = self._decode[level] = (cum16, bucket)
            return t

    def inverse_tables(self, level: str, layer: int):
        """``inverse.InverseTables`` of ``level`` and ``layer`` (its decode matrices), built on first use."""
        from sgl_remote_kv.codec.inverse import InverseTables

        with self._lock:
            t = self._inverse.get((level, layer))
            if t is None:
                t = self._inverse[level, layer] = InverseTables.build(
                    self.steps[level][layer], self.basis[layer]
                )
            return t

    def ctx0(self, layer: int, kv: int, group: int) -> int:
        return ((layer * 2 + kv) * self.groups + group) * self.group_dim

    # ---- files ------------------------------------------------------------------------------
    def save(self, directory: str | Path | None = None) -> Path:
        d = Path(directory) if directory else default_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{self.calib_id.hex()}.npz"
        meta = {
            "format": FORMAT,
            "model_key": self.model_key.hex(),
            "rope": json.loads(self.rope.canonical()),
            "report": self.report,
            "prob_bits": self.prob_bits,
            "sinks": self.sinks,
            "levels": sorted(self.steps),
            "calib_id": self.calib_id.hex(),
        }
        arrays = {"mean": self.mean, "basis": self.basis}
        for lv in self.steps:
            arrays[f"steps_{lv}"], arrays[f"freq_{lv}"] = self.steps[lv], self.freq[lv]
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """``CalibrationError`` for anything but a well-formed calibration whose content matches its id."""
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes())
                if meta.get("format") != FORMAT:
                    raise CalibrationError(f"{path}: calibration format {meta.get('format')} != {FORMAT}")
                levels = [str(lv) for lv in meta["levels"]]
                c = cls(
                    bytes.fromhex(meta["model_key"]),
                    RopeSpec(**meta["rope"]),
                    z["mean"],
                    z["basis"],
                    {lv: z[f"steps_{lv}"] for lv in levels},
                    {lv: z[f"freq_{lv}"] for lv in levels},
                    str(meta["report"]),
                    int(meta["sinks"]),
                    int(meta["prob_bits"]),
                )
        except CalibrationError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CalibrationError(f"{path}: not a calibration ({type(e).__name__}: {e})") from None
        if c.calib_id.hex() != meta["calib_id"]:
            raise CalibrationError(f"{path}: content does not match its id (corrupted?)")
        return c


# ---- registry (``registry.Registry``: ``<cache>/calibration/<id>.npz``) -------------------------------
_REGISTRY: Registry[Calibration] = Registry(
    "calibration", "calibration", Calibration.load, lambda c: c.calib_id, (CalibrationError,)
)
default_dir = _REGISTRY.default_dir
register = _REGISTRY.register
unregister = _REGISTRY.unregister
load_dir = _REGISTRY.load_dir
registered = _REGISTRY.items  # every registered calibration, in registration order


def lookup(calib_id: bytes) -> Calibration | None:
    """A registered calibration by id (the default directory is read on first use)."""
    load_dir()
    return _REGISTRY.get(calib_id)


def find_for(fp: ModelFingerprint, level: str = DEFAULT_LEVEL) -> Calibration:
    """A registered calibration of ``fp``'s model whose head groups fit ``fp``'s rank and that serves
    ``level``: the one with the largest groups (best ratio), the newest-registered among equals;
    ``CalibrationError`` saying what to run when there is none."""
    load_dir()
    key = model_key(fp)

    def fits(c: Calibration) -> bool:
        try:
            group_of(fp, c.groups, c.group_dim)
            return True
        except CalibrationError:
            return False

    hits = [c for c in registered() if c.model_key == key and fits(c)]
    hits.sort(key=lambda c: c.group_dim)  # stable: registration order among equal group sizes
    if not hits:
        raise CalibrationError(
            f"no transform-codec calibration for this model at TP {fp.tp_size} in {default_dir()}: run "
            f"`python -m sgl_remote_kv.codec.calibration --model-path <model> --tp {fp.tp_size}` once"
        )
    with_level = [c for c in hits if level in c.steps]
    if not with_level:
        raise CalibrationError(
            f"the calibrations of this model have no level {level} (have {hits[-1].levels})"
        )
    return with_level[-1]
