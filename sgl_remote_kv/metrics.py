"""Prometheus metrics of the remote KV tier, exported through SGLang's own ``/metrics`` endpoint.

SGLang (``--enable-metrics``) sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the scheduler
processes, and its HTTP server serves every process's samples through
``prometheus_client.multiprocess.MultiProcessCollector``. A metric created here with
``prometheus_client`` in the scheduler process therefore appears on the server's ``/metrics`` with
no further plumbing. Without ``--enable-metrics`` the metrics still exist in-process (tests read
``snapshot()``), they are just not exported.

Label values are closed sets (``types.FailureKind``, ``StoreErrorLabel``, ``LOOKUP_RESULTS``,
``DECISIONS``, the codec registry's names, ...): anything else is folded into ``internal``/``other`` and its raw text logged once.
Every labelled series is created at 0 when the metrics are built, so alerts see 0, not "no data".

Threads: any thread may update (prometheus_client metrics are thread-safe); ``snapshot()`` is for
tests and logs.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as _Tally

from sgl_remote_kv.codec.base import codec_names
from sgl_remote_kv.nvdec.adapter import LABELS as NVDEC_RESOLUTIONS
from sgl_remote_kv.store.breaker import rank
from sgl_remote_kv.types import (
    DECISIONS,
    DPU_JOB_OUTPUTS,
    EXACT_OUTCOMES,
    LOOKUP_RESULTS,
    QUALITY_LEVELS,
    STORE_OPS,
    WRITEBACK_SKIPS,
    FailureKind,
    StoreErrorLabel,
)

logger = logging.getLogger(__name__)

BREAKER_CIRCUITS = ("read", "write")
RESTART_REASONS = ("exited", "hung", "restarted")  # restarted: an attached service forgot this client
CODECS = tuple(codec_names())  # hit_tokens/hit_chunks{codec}: which codec's chunks served a hit
BUBBLE_KINDS = ("decoder_wait", "link_wait")  # nvdec_bubble_seconds{kind}
NO_LEVEL = "none"  # hit_tokens_by_quality{quality}: QUALITY_LEVELS, or this for codecs without levels

_LAT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RemoteKVMetrics:
    """One instance per process (``get()``); each method updates Prometheus and a local tally."""

    def __init__(self) -> None:
        self._tally: _Tally = _Tally()
        self._lock = threading.Lock()
        self._prom = None
        self._folded: set[str] = set()  # raw kinds folded into internal/other (logged once each)
        try:
            self._prom = _prometheus()
        except Exception as e:  # metrics are optional; never break serving over them
            logger.warning("remote-kv Prometheus metrics unavailable: %r", e)

    def _inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
        with self._lock:
            self._tally[key] += value
        if self._prom is not None:
            metric = self._prom[name]
            (metric.labels(**labels) if labels else metric).inc(value)

    def _set(self, name: str, value: float, **labels: str) -> None:
        """A gauge."""
        with self._lock:
            self._tally[name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))] = value
        if self._prom is not None:
            (self._prom[name].labels(**labels) if labels else self._prom[name]).set(value)

    def _observe(self, name: str, value: float) -> None:
        if self._prom is not None:
            self._prom[name].observe(value)

    # -- events ------------------------------------------------------------------------------------
    def lookup(self, result: str) -> None:
        """``hit`` / ``miss`` (the store answered) / ``error`` (it failed: unreachable, breaker open,
        its own deadline) / ``timeout`` (no answer within the glue's lookup timeout)."""
        self._inc("lookups", result=result)

    def store_error(self, op: str, kind: str, n: int = 1) -> None:
        """A failed store call (``StoreClient``'s error listener; any thread): ``op`` lookup / get /
        put / delete, ``kind`` the client's kind (unavailable / timeout / breaker_open / auth / corrupt /
        io:<errno> / ...), labelled by ``StoreErrorLabel``. ``corrupt`` comes once per corrupt value, from
        wherever it was found (``store/corruption.py``)."""
        label = StoreErrorLabel.of(kind)
        if label.value != kind:
            self._fold(f"store error {kind!r}", label.value)
        self._inc("store_errors", n, op=op if op in STORE_OPS else "other", kind=label.value)

    def store_breaker(self, circuit: str, state: str) -> None:
        """The scheduler's store client's ``circuit`` (read / write) breaker entered ``state``
        (gauge: 0 closed, 1 half-open, 2 open)."""
        self._set("store_breaker", rank(state), circuit=circuit if circuit in BREAKER_CIRCUITS else "read")

    def dataplane_restart(self, reason: str) -> None:
        """A DPU data plane was replaced (the DPU client's receiver thread): ``exited`` or ``hung``."""
        self._inc("dataplane_restarts", reason=reason if reason in RESTART_REASONS else "hung")

    def staging(self, bytes_per_token: float, codes: bool) -> None:
        """The host staging's arena bytes per row (token); ``codes``: its rows hold codes, not KV."""
        self._set("staging_bytes_per_token", bytes_per_token)
        self._set("staging_codes", float(codes))

    def dataplane_write(self, seconds: float, layers: int, output: str = "kv") -> None:
        """The DPU client's receiver thread spent ``seconds`` writing ``layers`` fetched layers of a run of a
        round's chunks (the data plane's ``output``: ``kv`` or ``codes``) into staging."""
        output = output if output in DPU_JOB_OUTPUTS else "kv"
        self._inc("dataplane_write_seconds", seconds, output=output)
        self._inc("dataplane_write_layers", layers, output=output)

    def hit(self, tokens: int, chunks: int, codec: str, quality: str | None = None) -> None:
        """A remote hit installed ``tokens`` (``chunks`` chunks) decoded by ``codec`` (a registry name) at
        ``quality`` (the transform codec's level; None for codecs without levels)."""
        label = codec if codec in CODECS else "other"
        if label != codec:
            self._fold(f"codec {codec!r}", label)
        self._inc("hit_tokens", tokens, codec=label)
        self._inc("hit_chunks", chunks, codec=label)
        self._inc("hit_tokens_by_quality", tokens, quality=quality if quality in QUALITY_LEVELS else NO_LEVEL)

    def exact_request(self, outcome: str) -> None:
        """A ``KVFidelity.EXACT`` request arrived: ``exact_path`` (parked to look up and fetch from exact
        codecs only), ``local_hit`` (not parked: the local radix cache served its prompt up to everything
        a remote hit could have -- all its full chunks and tail sub-chunks; half of it for a prompt shorter
        than any of them --: ``admission.queue.exact_outcome``) or ``recompute`` (not parked, and nothing or
        only a few leading tokens, e.g. a chat template's, matched locally: the bulk of it is computed)."""
        self._inc("exact_requests", outcome=outcome if outcome in EXACT_OUTCOMES else "recompute")

    def fetched(
        self, nbytes: int, decoded_bytes: int, fetch_s: float, decode_s: float | None, wait_s: float
    ) -> None:
        """A fetch ended. ``decode_s`` is None where no decode ran in this process (the DPU path: the
        data plane's decode is inside ``fetch_s``); ``wait_s`` is parking -> KV ready."""
        self._inc("fetched_bytes", nbytes)
        self._inc("decoded_bytes", decoded_bytes)
        self._observe("fetch_latency", fetch_s)
        if decode_s is not None:
            self._observe("decode_latency", decode_s)
        self._observe("kv_wait", wait_s)

    def failure(self, kind: str | FailureKind) -> None:
        label = FailureKind.of(kind)
        if label.value != kind:
            self._fold(f"failure kind {kind!r}", label.value)
        self._inc("failures", kind=label.value)

    def _fold(self, what: str, into: str) -> None:
        if what not in self._folded and len(self._folded) < 1024:
            self._folded.add(what)
            logger.warning("remote-kv metrics: %s counted as %r", what, into)

    def decision(self, path: str) -> None:
        self._inc("decisions", path=path)

    def dedup(self) -> None:
        self._inc("dedup_followers")

    def slot_wait(self, seconds: float) -> None:
        """A request that chose to fetch waited ``seconds`` for staging rows before its fetch started."""
        self._inc("slot_waits")
        self._observe("slot_wait", seconds)

    def layerwise_admission(self) -> None:
        self._inc("layerwise_admissions")

    def layerwise_wait(self, seconds: float) -> None:
        self._inc("layerwise_wait", seconds)

    def writeback(self, chunks: int, nbytes: int) -> None:
        self._inc("written_chunks", chunks)
        self._inc("written_bytes", nbytes)

    def writeback_skipped(self, reason: str, chunks: int = 1) -> None:
        self._inc("writeback_skipped", chunks, reason=reason)

    def writeback_queue(self, nbytes: int) -> None:
        """KV bytes the write-back holds queued (not yet being written)."""
        self._set("writeback_queue_bytes", nbytes)

    # -- NVDEC adaptive resolution (labels: ``nvdec.adapter.LABELS``, tokens per frame or "full") ------
    def nvdec_chunk(self, nbytes: float, resolution: str) -> None:
        """The NVDEC path installed a chunk fetched at ``resolution`` (``nbytes`` on the wire)."""
        r = self._resolution(resolution)
        self._inc("nvdec_chunks", 1, resolution=r)
        self._inc("nvdec_bytes", nbytes, resolution=r)

    def nvdec_fallback(self, n: float = 1.0, resolution: str = "full") -> None:
        """The store lacked a chunk's version at ``resolution``; the fetch tried the next one."""
        self._inc("nvdec_fallbacks", n, resolution=self._resolution(resolution))

    def nvdec_written(self, nbytes: float, resolution: str) -> None:
        """The write-back stored a chunk's version at ``resolution`` (the store cost of each version)."""
        r = self._resolution(resolution)
        self._inc("nvdec_written_chunks", 1, resolution=r)
        self._inc("nvdec_written_bytes", nbytes, resolution=r)

    def nvdec_bubble(self, seconds: float, kind: str) -> None:
        """Pipeline bubbles of an NVDEC fetch: ``decoder_wait`` (no chunk of it decoding while bytes were
        still coming) or ``link_wait`` (the link stopped while the bitstream buffer was full)."""
        self._inc("nvdec_bubble_seconds", seconds, kind=kind if kind in BUBBLE_KINDS else "decoder_wait")

    def _resolution(self, resolution: str) -> str:
        if resolution in NVDEC_RESOLUTIONS:
            return resolution
        self._fold(f"nvdec resolution {resolution!r}", "other")
        return "other"

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._tally)


_LIVE = {"multiprocess_mode": "livemax"}
_SKIPPED_HELP = (
    "Write-back chunks not written: present (in the store), queue_full (oldest dropped: queue over its MiB)"
)


def _build_prometheus() -> dict:
    from prometheus_client import Counter, Gauge, Histogram

    p = "sglang:remote_kv_"
    metrics = {
        "lookups": Counter(p + "lookups", "Remote prefix lookups by result", ["result"]),
        "store_errors": Counter(
            p + "store_errors", "Failed store calls (each became a miss or a dropped write)", ["op", "kind"]
        ),
        "hit_tokens": Counter(
            p + "hit_tokens", "Prompt tokens served from the remote KV tier, by codec", ["codec"]
        ),
        "hit_chunks": Counter(p + "hit_chunks", "Chunks served from the remote KV tier, by codec", ["codec"]),
        "hit_tokens_by_quality": Counter(
            p + "hit_tokens_by_quality",
            "Prompt tokens served from the remote KV tier, by the transform codec's quality level (KL target; "
            f"'{NO_LEVEL}' for codecs without levels)",
            ["quality"],
        ),
        "exact_requests": Counter(
            p + "exact_requests",
            "Requests that demanded exact KV (custom_params remote_kv=exact), by what served them: "
            "exact_path (looked up on an exact-codec path), local_hit (the local radix cache matched the "
            "prompt up to all a remote hit could serve: every full chunk and tail sub-chunk, or half of a "
            "shorter prompt), recompute (the bulk computed: nothing or only a few leading tokens matched)",
            ["outcome"],
        ),
        "fetched_bytes": Counter(p + "fetched_bytes", "Compressed bytes fetched from the store"),
        "decoded_bytes": Counter(p + "decoded_bytes", "KV bytes produced by decoding fetched chunks"),
        "failures": Counter(p + "failures", "Remote KV failures (each became a miss)", ["kind"]),
        "decisions": Counter(p + "decisions", "Policy decisions by path", ["path"]),
        "dedup_followers": Counter(
            p + "dedup_followers", "Requests that waited on another's in-flight fetch"
        ),
        "store_breaker": Gauge(
            p + "store_breaker_state",
            "Store circuit breaker: 0 closed, 1 half-open, 2 open",
            ["circuit"],
            **_LIVE,
        ),
        "staging_bytes_per_token": Gauge(
            p + "staging_bytes_per_token", "Host staging bytes per token", **_LIVE
        ),
        "staging_codes": Gauge(p + "staging_codes", "1: staging holds codes for the GPU; 0: KV", **_LIVE),
        "slot_waits": Counter(p + "slot_waits", "Fetches that waited for staging rows before they started"),
        "dataplane_restarts": Counter(p + "dataplane_restarts", "DPU data planes replaced", ["reason"]),
        "dataplane_write_seconds": Counter(
            p + "dataplane_write_seconds", "Receiver seconds writing fetched layers, by output", ["output"]
        ),
        "dataplane_write_layers": Counter(
            p + "dataplane_write_layers", "Layer writes of the DPU client's receiver, by output", ["output"]
        ),
        "slot_wait": Histogram(
            p + "slot_wait_seconds",
            "Time a fetch waited for staging rows before it started (bounded by slot_wait_s)",
            buckets=_LAT_BUCKETS,
        ),
        "layerwise_wait": Counter(
            p + "layerwise_wait_seconds", "Time forward passes waited for layer-wise installs"
        ),
        "layerwise_admissions": Counter(
            p + "layerwise_admissions", "Requests admitted before their fetched KV was in the pool"
        ),
        "written_chunks": Counter(p + "written_chunks", "Chunks written back to the store"),
        "written_bytes": Counter(p + "written_bytes", "Compressed bytes written back"),
        "writeback_skipped": Counter(p + "writeback_skipped", _SKIPPED_HELP, ["reason"]),
        "writeback_queue_bytes": Gauge(
            p + "writeback_queue_bytes", "KV bytes queued for the write-back", **_LIVE
        ),
        "fetch_latency": Histogram(
            p + "fetch_seconds",
            "Fetch time per request (store get; on the DPU path the data plane's whole job incl. decode)",
            buckets=_LAT_BUCKETS,
        ),
        "decode_latency": Histogram(
            p + "decode_seconds",
            "Decode time per request, on paths that decode in the serving process (not the DPU path)",
            buckets=_LAT_BUCKETS,
        ),
        "kv_wait": Histogram(
            p + "kv_wait_seconds",
            "Time from parking a request in waiting_for_KV until its KV was ready (the fetch ended)",
            buckets=_LAT_BUCKETS,
        ),
        "nvdec_chunks": Counter(
            p + "nvdec_chunks", "Chunks the NVDEC path installed, by the resolution fetched", ["resolution"]
        ),
        "nvdec_bytes": Counter(
            p + "nvdec_bytes",
            "Wire bytes of the chunks the NVDEC path installed, by resolution",
            ["resolution"],
        ),
        "nvdec_fallbacks": Counter(
            p + "nvdec_fallbacks",
            "NVDEC fetches of a chunk version the store lacked (the next resolution was tried)",
            ["resolution"],
        ),
        "nvdec_written_chunks": Counter(
            p + "nvdec_written_chunks",
            "Chunk versions written back for the NVDEC path, by resolution",
            ["resolution"],
        ),
        "nvdec_written_bytes": Counter(
            p + "nvdec_written_bytes",
            "Bytes of the chunk versions written back for the NVDEC path, by resolution (store cost)",
            ["resolution"],
        ),
        "nvdec_bubble_seconds": Counter(
            p + "nvdec_bubble_seconds",
            "NVDEC fetch pipeline bubbles: decoder_wait (decoders idle for bytes), link_wait (link idle, "
            "bitstream buffer full)",
            ["kind"],
        ),
    }
    for res in (*NVDEC_RESOLUTIONS, "other"):
        for name in (
            "nvdec_chunks",
            "nvdec_bytes",
            "nvdec_fallbacks",
            "nvdec_written_chunks",
            "nvdec_written_bytes",
        ):
            metrics[name].labels(resolution=res)
    for kind in BUBBLE_KINDS:
        metrics["nvdec_bubble_seconds"].labels(kind=kind)
    for kind in FailureKind:  # every known series exists (at 0) from the start
        metrics["failures"].labels(kind=kind.value)
    for op in (*STORE_OPS, "other"):
        for label in StoreErrorLabel:
            metrics["store_errors"].labels(op=op, kind=label.value)
    for result in LOOKUP_RESULTS:
        metrics["lookups"].labels(result=result)
    for path in DECISIONS:
        metrics["decisions"].labels(path=path)
    for reason in WRITEBACK_SKIPS:
        metrics["writeback_skipped"].labels(reason=reason)
    for codec in (*CODECS, "other"):
        metrics["hit_tokens"].labels(codec=codec)
        metrics["hit_chunks"].labels(codec=codec)
    for level in (*QUALITY_LEVELS, NO_LEVEL):
        metrics["hit_tokens_by_quality"].labels(quality=level)
    for outcome in EXACT_OUTCOMES:
        metrics["exact_requests"].labels(outcome=outcome)
    for circuit in BREAKER_CIRCUITS:
        metrics["store_breaker"].labels(circuit=circuit).set(0)
    for reason in RESTART_REASONS:
        metrics["dataplane_restarts"].labels(reason=reason)
    return metrics


_PROM: dict | None = None
_PROM_LOCK = threading.Lock()


def _prometheus() -> dict:
    """The process's collectors, built once (a second registration of the same names would fail):
    every ``RemoteKVMetrics`` of the process exports through them."""
    global _PROM
    with _PROM_LOCK:
        if _PROM is None:
            _PROM = _build_prometheus()
        return _PROM


_INSTANCE: RemoteKVMetrics | None = None
_INSTANCE_LOCK = threading.Lock()


def get() -> RemoteKVMetrics:
    global _INSTANCE
    with _INSTANCE_LOCK:
        if _INSTANCE is None:
            _INSTANCE = RemoteKVMetrics()
        return _INSTANCE
