"""Typed records shared by every component (codecs, stores, data planes, SGLang glue).

Nothing here imports torch or SGLang: the data-plane process and the codecs depend only on numpy.

KV tensors at our boundaries are numpy arrays shaped ``[num_layers, num_tokens, num_kv_heads, head_dim]``
(one array for K, one for V). ``bfloat16`` has no numpy dtype, so bf16 KV travels as ``np.uint16`` holding
the raw bits; ``KVLayout.dtype`` names the real element type. ``numpy_storage_dtype`` maps one to the other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

import numpy as np

KV_DTYPES = ("float32", "float16", "bfloat16")
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def numpy_storage_dtype(dtype: str) -> np.dtype:
    """numpy dtype that holds elements of KV dtype ``dtype`` (bf16 -> uint16 raw bits)."""
    try:
        return np.dtype(_STORAGE[dtype])
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {KV_DTYPES}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV across the model (per TP rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # one of KV_DTYPES

    def __post_init__(self) -> None:
        numpy_storage_dtype(self.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if not 0 < getattr(self, name) <= 65536:
                raise ValueError(f"KVLayout.{name} out of range: {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return numpy_storage_dtype(self.dtype).itemsize

    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that makes KV of one deployment incompatible with another's.

    ``weights_id`` is a hex digest identifying the weights (see ``model.weights_identity``).
    """

    architecture: str
    layout: KVLayout
    weights_id: str
    tp_rank: int = 0
    tp_size: int = 1

    def canonical(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_canonical(cls, raw: bytes | str) -> ModelFingerprint:
        """The fingerprint ``canonical()`` gave ``raw``; ``ValueError`` for anything else."""
        try:
            d = json.loads(raw)
            fp = cls(**{**d, "layout": KVLayout(**d["layout"])})
        except (TypeError, KeyError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, a layout's
            raise ValueError(f"not a canonical model fingerprint: {e!r}") from None
        if fp.canonical() != (raw.encode() if isinstance(raw, str) else bytes(raw)):
            raise ValueError("not a canonical model fingerprint")
        return fp

    def digest(self) -> bytes:
        """32-byte SHA-256 over the canonical JSON form (stable across processes and hosts)."""
        return hashlib.sha256(self.canonical()).digest()


# Quality levels of the transform codec: KL targets (nats of next-token KL against recomputation on the
# calibration texts), finest first. The default is the finest level that met the near-lossless floor
# (KL <= 0.001 and top-1 >= 0.98) on held-out texts (docs/CODEC.md): "0.001" met the KL but not top-1.
QUALITY_LEVELS = ("0.0005", "0.001", "0.002", "0.005", "0.01")
DEFAULT_QUALITY = "0.0005"

# The transform codec's quantizer (``--remote-kv-quantizer``): rint per value, or trellis-coded (no rANS;
# docs/CODEC.md "Trellis-coded quantization"). A deployment writes the trellis unless told otherwise (smaller
# at the same KL; task accuracy within a point of recompute, docs/results/task_accuracy.json); a chunk whose
# params name no quantizer is scalar (``SCALAR_QUANTIZER``: chunks written before the trellis keep their keys).
QUANTIZERS = ("scalar", "trellis")
SCALAR_QUANTIZER = "scalar"
DEFAULT_QUANTIZER = "trellis"

# The transform codec's entropy stage (``--remote-kv-entropy``): ``default`` = Deflate (what a data plane's
# engine inflates), and for ``--remote-kv inproc`` (the host entropy-decodes) zstd with the trellis, rANS with
# the scalar quantizer; zstd: ~2% larger chunks than Deflate, its lossless stage ~1.7x as fast on a CPU
# (docs/CODEC.md "Entropy stage"); the trellis refuses rANS.
ENTROPIES = ("default", "deflate", "zstd", "rans")

ROPE_STYLES = ("neox", "gptj")

# What the DPU data plane writes for the KV pool's writer (``--remote-kv-dpu-output``): decoded KV, the
# codec's lossless-stage output (codes) that the writer dequantizes, or codes only for a device pool.
DPU_JOB_OUTPUTS = ("kv", "codes")  # what a data-plane job writes (``SubmitFetch.output``)
DPU_OUTPUTS = ("auto", *DPU_JOB_OUTPUTS)

# Where the write-back's host encode runs (``--remote-kv-writeback-encoder``): encoder processes outside the
# scheduler process (``writeback/encoders.py``), or the write-back's own threads in it.
WRITEBACK_ENCODERS = ("process", "thread")


@dataclass(frozen=True)
class RopeSpec:
    """The rotary position embedding a model applies to its cached keys (what a codec must undo to see
    position-free keys, and re-apply after decoding). ``style``: ``neox`` rotates dimension ``i`` with
    ``i + rotary_dim/2`` (HF Llama's ``rotate_half``), ``gptj`` rotates interleaved pairs. Only unscaled
    RoPE is described; a model with ``rope_scaling`` has no ``RopeSpec`` (``from_hf_config`` says why)."""

    theta: float
    rotary_dim: int
    style: str = "neox"

    def __post_init__(self) -> None:
        if self.style not in ROPE_STYLES:
            raise ValueError(f"rope style {self.style!r} not in {ROPE_STYLES}")
        if not (self.theta > 1.0 and self.rotary_dim > 0 and self.rotary_dim % 2 == 0):
            raise ValueError(f"bad rope parameters theta={self.theta} rotary_dim={self.rotary_dim}")

    def canonical(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_hf_config(cls, cfg) -> RopeSpec:
        """From a transformers config (object or dict). ``ValueError`` naming the reason for RoPE this
        record cannot describe (scaled variants such as llama3/yarn, partial rotary factors)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        params = get("rope_parameters") or {}
        scaling = get("rope_scaling") or {}
        theta = params.get("rope_theta", get("rope_theta", None))
        kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if theta is None:
            raise ValueError("the model config names no rope_theta")
        if kind != "default":
            raise ValueError(f"rope type {kind!r} is not supported (only unscaled RoPE)")
        if float(get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        try:
            head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
            return cls(float(theta), int(head_dim), "neox")
        except (TypeError, ZeroDivisionError) as e:  # fields missing or malformed
            raise ValueError(f"the model config's head size is unusable: {e}") from None


class FailureKind(str, Enum):
    """Why (part of) a remote hit became a miss: the closed set of ``failures_total{kind}`` label values.
    Anything else is counted as ``INTERNAL`` (the raw detail goes to the log, never into a label)."""

    # the store / the fetch
    MISS = "miss"  # the data plane's store answered absent
    STORE_MISS = "store_miss"
    STORE_TIMEOUT = "store_timeout"
    STORE_UNAVAILABLE = "store_unavailable"
    STORE_BREAKER_OPEN = "store_breaker_open"
    STORE_AUTH = "store_auth"  # the store refused the data plane's credentials
    STORE_CORRUPT = "store_corrupt"
    STORE_OTHER = "store_other"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"
    BAD_REQUEST = "bad_request"
    DECODE_CORRUPT = "decode:CorruptChunk"
    DECODE_FOREIGN = "decode:ForeignChunk"
    DECODE_VERSION = "decode:UnsupportedVersion"
    DECODE_LIMIT = "decode:LimitExceeded"
    DECODE_CHUNK_SIZE = "decode:chunk_size"
    DATAPLANE_LOST = "dataplane_lost"
    CANCELLED = "cancelled"
    FETCH_TIMEOUT = "fetch_timeout"
    ABANDONED = "abandoned"
    # installing into SGLang
    WRITE = "write"  # a write into staging rows (or the linker's copy into the KV pool) failed or timed out
    NO_STAGING_ROWS = "no_staging_rows"  # no staging rows within slot_wait_s
    INSTALL = "install"
    LOCAL_PREFIX_EVICTED = "local_prefix_evicted"
    ABORTED_WHILE_WAITING = "aborted_while_waiting"
    TP_PEER_MISS = "tp_peer_miss"
    PARK = "park"
    LAYERWISE_FALLBACK = "layerwise_fallback"
    LAYERWISE_DECODE_ERROR = "layerwise_decode_error"
    REPAIR_UNDECODABLE = "repair_undecodable"
    # the write-back
    WRITEBACK = "writeback"
    WRITEBACK_OFFER = "writeback_offer"
    WRITEBACK_STORE = "writeback:store"
    INTERNAL = "internal"

    @classmethod
    def of(cls, kind: str) -> FailureKind:
        """The label for ``kind`` (a known value, or a ``store_<client kind>`` -> ``STORE_OTHER``, else
        ``INTERNAL``)."""
        try:
            return cls(kind)
        except ValueError:
            return cls.STORE_OTHER if str(kind).startswith("store_") else cls.INTERNAL


class PathName(str, Enum):
    """A fetch path: how a remote prefix gets into the KV pool (``--remote-kv`` modes pick the set). The
    order of the members is the column order of the TP agreement's rows."""

    DPU = "dpu"  # the DPU data plane process decodes and writes into the pool
    INPROC = "inproc"  # worker threads of the serving process decode; the install writes
    NVDEC = "nvdec"  # the decoder pool (NVDEC or FFmpeg) decodes hevc and writes into the pool


class StoreErrorLabel(str, Enum):
    """``store_errors_total{kind}`` label values: the store client's error kinds, closed (``io:<errno>`` ->
    ``io``; exception names -> ``other``)."""

    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    BREAKER_OPEN = "breaker_open"
    AUTH = "auth"  # the store refused our credentials (a configuration error: not retried)
    CORRUPT = "corrupt"  # a value failed an integrity check (store frame, MAC, codec CRCs): once per value
    INVALID = "invalid"
    CLOSED = "closed"
    IO = "io"
    OTHER = "other"

    @classmethod
    def of(cls, kind: str) -> StoreErrorLabel:
        if str(kind).startswith("io:"):
            return cls.IO
        try:
            return cls(kind)
        except ValueError:
            return cls.OTHER


class KVFidelity(str, Enum):
    """What KV a request accepts from the remote tier: its ``custom_params`` entry ``"remote_kv"``
    (``REQUEST_PARAM``), through ``/generate``'s ``sampling_params`` or the OpenAI API's ``extra_body``.

    ``ANY`` (the default): chunks of the deployment's codec, lossy or not. ``EXACT``: only KV equal to
    what the model computes: chunks of an exact codec (``Codec.exact``) or a recompute, never KV decoded
    from quantized chunks, neither from the store nor from the local radix tree."""

    ANY = "any"
    EXACT = "exact"

    @classmethod
    def of_params(cls, custom_params) -> KVFidelity:
        """The fidelity a request's ``custom_params`` ask for; ``ValueError`` for a value we do not know."""
        if not isinstance(custom_params, dict) or custom_params.get(REQUEST_PARAM) is None:
            return cls.ANY
        value = custom_params[REQUEST_PARAM]
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(
                f"custom_params[{REQUEST_PARAM!r}] must be one of {allowed}, got {value!r}"
            ) from None


REQUEST_PARAM = "remote_kv"  # the custom_params key of KVFidelity
# exact_requests_total{outcome}: exact_path (parked to fetch from an exact path), local_hit (not parked: the
# local radix cache matched the prompt up to all a remote hit could serve: admission.queue.exact_outcome),
# recompute (not parked; nothing, or only a few leading tokens such as a chat template's, matched locally)
EXACT_OUTCOMES = ("exact_path", "local_hit", "recompute")


STORE_OPS = ("lookup", "get", "put", "delete")
LOOKUP_RESULTS = ("hit", "miss", "error", "timeout")
DECISIONS = (*(p.value for p in PathName), "recompute", "probe")
WRITEBACK_SKIPS = ("queue_full", "present")
