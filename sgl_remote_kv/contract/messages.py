"""The data-plane messages: the typed records a host (the DPU client, the store proxy's clients) and a
data plane exchange, with the bounds every field is validated against. Framing (envelope, kind numbers,
``encode``/``decode``/``drain``) is ``protocol.py``, which also re-exports every name here; changing a
message's fields is a protocol change (bump ``protocol.PROTOCOL_VERSION``).

Each message is a frozen msgspec Struct, strict (``forbid_unknown_fields``); its fields carry bounds
(``Meta``), and a few cross-field rules are checked in ``__post_init__`` (``ValueError``, which
``protocol.decode`` turns into ``BadFrame``). ``Warmup`` is not a frame: the data plane's ``--warm``
argument, JSON (``protocol.encode_warmup``/``decode_warmup``).

Event order of one job (docs/DPU.md): ``ChunksVerified`` once every chunk was fetched and parsed
(header + checksum; with the job's compressed blobs copied into the host-visible blob area when
``SubmitFetch.blob_cap`` > 0); ``LayerDone`` per chunk and layer group as soon as it is in the
destination (a chunk is decoded as soon as it was fetched, so chunks fetched early may report layers
before ``ChunksVerified``; the host never relies on the order of the two; each chunk's layers in
order; lower layers first);
a chunk's ``LayerDone`` s before its ``ChunkDone``; ``JobDone`` last; ``ChunkFailed`` whenever a chunk
fails.

Threads: immutable values; any thread may build, read or share them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_FRAME_BYTES = 4 << 20  # one encoded frame (``protocol.decode`` checks it first)
MAX_CHUNKS = 4096
MAX_LAYERS = 1024
MAX_DEST_BYTES = 1 << 48

U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0, le=MAX_DEST_BYTES)]
JobId = Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
ShortText = Annotated[str, msgspec.Meta(max_length=4096)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=65536)]


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    num_kv_heads: Positive
    head_dim: Positive
    dtype: Annotated[str, msgspec.Meta(pattern="^(float32|float16|bfloat16)$")]


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``types.ModelFingerprint`` on the wire; ``digest`` must equal the rebuilt fingerprint's digest."""

    architecture: Name
    layout: Layout
    weights_id: ShortText
    tp_rank: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=65536)]
    digest: Key


class Warmup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the data plane decodes once at start (``--warm``, JSON): the codec and model of the jobs it
    will get, so its first real job does not pay for kernels loaded on first use (``Codec.warm_up``)."""

    codec: Name
    codec_params: Annotated[str, msgspec.Meta(max_length=4096)]  # canonical JSON
    fingerprint: Fingerprint


class ChunkDest(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Where one chunk's decoded KV goes in the destination region (byte offsets).

    Output ``kv``: layer ``l`` of K is written at ``k_off + l * layer_stride`` (``tokens * heads * dim *
    itemsize`` contiguous bytes), V likewise from ``v_off``. Output ``codes``: layer ``l``'s lossless-stage
    output (K and V) is written at ``k_off + l * layer_stride``, at most ``layer_stride`` bytes (at least
    the layer's K + V bytes as KV); ``v_off`` is unused.
    """

    key: Key
    tokens: Annotated[int, msgspec.Meta(ge=1, le=65536)]
    k_off: U64
    v_off: U64
    layer_stride: U64


class SubmitFetch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Fetch ``chunks`` (a prefix, in order) of request ``request_id`` into ``dest_name``."""

    job: JobId
    request_id: ShortText
    codec: Name
    codec_params: Annotated[bytes, msgspec.Meta(max_length=4096)]  # canonical JSON
    fingerprint: Fingerprint
    dest_name: Name
    chunks: Annotated[list[ChunkDest], msgspec.Meta(min_length=1, max_length=MAX_CHUNKS)]
    # Host-visible blob area ``[blob_off, blob_off + blob_cap)`` of the destination region: the data
    # plane copies the job's verified compressed blobs there before ``ChunksVerified`` (0: no copy).
    blob_off: U64 = 0
    blob_cap: U64 = 0
    # What the data plane writes into the destination: decoded KV, or each layer's lossless-stage output
    # (the codec's codes / symbols, ``Codec.device_dequant`` codecs only) that the pool's writer
    # dequantizes on the device (``KVWriter.write_quantized``); then the dequant and DMA stages are skipped.
    output: Literal["kv", "codes"] = "kv"

    def __post_init__(self) -> None:
        ends = [self.blob_off + self.blob_cap]
        for c in self.chunks:
            ends.append(c.k_off)
            ends.append(c.v_off)
        if max(ends) >= MAX_DEST_BYTES:
            raise ValueError("destination offset out of range")


class Cancel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cancel chunks ``from_chunk..`` of ``job`` (0: the whole job)."""

    job: JobId
    from_chunk: U32 = 0


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq: U32
    sent_ns: Annotated[int, msgspec.Meta(ge=0)]


class Pong(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Answer to ``Heartbeat``. ``registered``: the data plane knows the sending peer (a ``Register`` of
    this connection was accepted); False after a service restart tells the client to register again."""

    seq: U32
    sent_ns: Annotated[int, msgspec.Meta(ge=0)]
    pid: U32
    jobs_active: U32
    stats_json: Annotated[bytes, msgspec.Meta(max_length=65536)] = b"{}"
    registered: bool = False


MAX_REGIONS = 16
Session = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Register(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A host client (one ``DpuClient``: one TP rank of one server) announces itself on this connection:
    the model it fetches for, the codec, and the destination regions (POSIX shm names it created) the
    data plane may write into for it. Must precede its first ``SubmitFetch``; every later ``SubmitFetch``
    must name this fingerprint and codec and one of these regions. ``session``: random per client
    instance; a ``Register`` with the session of a registered peer replaces that registration (a client
    reconnecting after a missed heartbeat)."""

    session: Session
    label: ShortText  # for logs: e.g. "pid 1234 tp 0/2"
    fingerprint: Fingerprint
    codec: Name
    codec_params: Annotated[bytes, msgspec.Meta(max_length=4096)]  # canonical JSON
    regions: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=MAX_REGIONS)]


class Registered(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Answer to ``Register``: ``ok``, or why not (``detail``: unknown region, inconsistent or foreign
    fingerprint, unknown codec, ...). ``client_timeout_ms``: the data plane drops a registered client
    (cancels its jobs, releases its regions) that sent nothing for this long (0: never)."""

    ok: bool
    detail: Annotated[str, msgspec.Meta(max_length=512)] = ""
    client_timeout_ms: U32 = 0
    pid: U32 = 0  # the data plane's process id


class Goodbye(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The client leaves: its jobs are cancelled and its regions released (no answer)."""


class BlobRef(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Where one verified compressed blob sits in the destination region (absolute byte offset)."""

    off: U64
    length: Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAME_BYTES * 64)]


class ChunksVerified(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every chunk of ``job`` was fetched and parsed; chunks ``0 .. ok-1`` are intact (header, checksum,
    size). ``blobs``: one ``BlobRef`` per intact chunk, in chunk order, when the job had a blob area and
    they all fit; empty otherwise (the host then cannot decode them itself)."""

    job: JobId
    ok: U32
    blobs: Annotated[list[BlobRef], msgspec.Meta(max_length=MAX_CHUNKS)] = []

    def __post_init__(self) -> None:
        if self.blobs and len(self.blobs) != self.ok:
            raise ValueError("blobs must be empty or one per intact chunk")


class ChunkDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    job: JobId
    chunk: U32
    wire_bytes: U64 = 0  # size of the codec blob the store returned (compressed)


class LayerDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Layers ``layer .. layer+count-1`` of ``chunk`` are in the destination region. Output ``codes``:
    ``lengths`` holds the bytes written for each of them (``count`` entries); output ``kv``: empty."""

    job: JobId
    chunk: U32
    layer: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)] = 1
    lengths: Annotated[list[U64], msgspec.Meta(max_length=MAX_LAYERS)] = []

    def __post_init__(self) -> None:
        if self.lengths and len(self.lengths) != self.count:
            raise ValueError("LayerDone.lengths must hold one length per layer")


FAIL_KINDS = (
    "miss",  # the store answered absent
    "store_error",  # the data plane's store client failed (``ChunkFailed.store_error`` says how)
    "corrupt",  # CorruptChunk / LimitExceeded / UnsupportedVersion, or a value failing the store framing
    "foreign",  # ForeignChunk: another model, codec or params
    "cancelled",
    "bad_request",  # destination out of bounds, unknown codec, inconsistent fingerprint
    "internal",  # an unexpected exception in a worker (counted and logged)
    "dataplane_lost",  # host side only: the data plane died or hung
)


# The data plane's store client error kind (``store.client``: timeout, unavailable, breaker_open, auth,
# corrupt, io:<errno>, an exception type name, ...): the host counts it as ``store_errors_total{op="get",kind}``.
StoreErrorKind = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9_:.-]*\Z")]


class ChunkFailed(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Chunk ``chunk`` of ``job`` failed. ``store_error``: the store client's error kind when the store
    call behind the failure failed (required with kind ``store_error``), or ``corrupt`` (with kind
    ``corrupt``) for a value whose bytes are damaged: it failed the store framing or MAC (the store client
    deleted it) or the codec's header / section CRCs (``codec.errors.CORRUPTION``); the host counts each
    such chunk once as ``store_errors_total{op="get",kind}``. Empty otherwise (a foreign or newer-version
    chunk, a miss, ...). A corrupt chunk's ``detail`` names its key (``store.corruption.detail``)."""

    job: JobId
    chunk: U32
    kind: Annotated[str, msgspec.Meta(pattern="^(" + "|".join(FAIL_KINDS) + ")$")]
    detail: Annotated[str, msgspec.Meta(max_length=512)] = ""
    store_error: StoreErrorKind = ""

    def __post_init__(self) -> None:
        if self.kind == "store_error" and not self.store_error:
            raise ValueError("kind store_error needs the store client's error kind")


class JobDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every chunk of ``job`` is terminal and the data plane holds no buffer for it any more."""

    job: JobId
    done: U32
    failed: U32


StoreOp = Literal["count_prefix", "get_many", "put_many", "delete_many"]
MAX_STORE_KEYS = 4096
MAX_VALUE_BYTES = 256 << 20  # one stored value (a chunk blob + its framing)


class StoreRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Store proxy (``dpu/store_proxy.py``): one ``KVStore`` call made for a host that cannot reach the
    store itself. Frame 1 of a multipart message; ``put_many`` sends one more frame per key (its value,
    already framed and checksummed by the host's ``StoreClient``: the proxy stores bytes verbatim)."""

    req: U64
    op: StoreOp
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_STORE_KEYS)]


class StoreReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Answer to ``StoreRequest`` ``req``: ``error`` is empty or the backend's failure kind (``StoreError.kind``:
    ``unavailable``, ``timeout``, ...; ``bad_request``). ``count``: ``count_prefix``'s answer. ``present``
    (``get_many``): one flag per key; one more frame follows per present key, in key order."""

    req: U64
    error: Annotated[str, msgspec.Meta(max_length=64)] = ""
    count: U32 = 0
    present: Annotated[list[bool], msgspec.Meta(max_length=MAX_STORE_KEYS)] = []


Message = (
    SubmitFetch
    | Cancel
    | Heartbeat
    | Pong
    | ChunkDone
    | LayerDone
    | ChunkFailed
    | JobDone
    | ChunksVerified
    | Register
    | Registered
    | Goodbye
    | StoreRequest
    | StoreReply
)
