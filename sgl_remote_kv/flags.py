"""The ``--remote-kv*`` flags of a server (``add_flags``, also the keyword arguments of
``sglang.Engine``: ``RemoteKVConfig.from_kwargs``) and the argparse types that check their values; the
config they parse into is ``config.RemoteKVConfig``."""

from __future__ import annotations

import argparse

from sgl_remote_kv.contract.endpoints import is_endpoint
from sgl_remote_kv.contract.settings import cpu_list_arg
from sgl_remote_kv.types import (
    DEFAULT_QUALITY,
    DEFAULT_QUANTIZER,
    DPU_OUTPUTS,
    ENTROPIES,
    QUALITY_LEVELS,
    QUANTIZERS,
    WRITEBACK_ENCODERS,
)

MODES = ("off", "dpu", "nvdec", "inproc", "auto")
FLUSH_SCOPES = ("local", "tier")
MAX_CHUNK_SIZE = 8192
DEFAULT_TAIL_TOKENS = 64


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--remote-kv*`` flags (``RemoteKVConfig.add_cli_args``): SGLang's parser gets them from the plugin."""
    g = parser.add_argument_group("sgl-remote-kv (remote compressed KV tier)")
    g.add_argument(
        "--remote-kv",
        dest="remote_kv",
        default="off",
        choices=MODES,
        help="Remote KV tier: off, dpu (DPU data plane), nvdec (video decoder pool), "
        "inproc (decode inside the serving process: the baseline), auto.",
    )
    g.add_argument(
        "--remote-kv-store",
        dest="remote_kv_store",
        default="",
        type=_store_url,
        metavar="URL",
        help="Store URL: file:///dir (embedded, default), redis://host:port/db, rediss://host:port/db "
        "(TLS), redis+cluster://host:port[,host:port], rediss+cluster://..., dpu+ipc:///path or "
        "dpu+tcp://host:port (a data-plane service's store proxy). Keep a password out of it (it would "
        "show in ps): --remote-kv-store-password-file or SRKV_STORE_PASSWORD.",
    )
    g.add_argument(
        "--remote-kv-store-password-file",
        dest="remote_kv_store_password_file",
        type=_password_file,
        default="",
        metavar="PATH",
        help="File holding the Redis store's password (one line), for a --remote-kv-store URL without "
        "one; every process of the tier reads it from there, so it never shows on a command line. "
        "Or set SRKV_STORE_PASSWORD.",
    )
    g.add_argument(
        "--remote-kv-chunk-size",
        dest="remote_kv_chunk_size",
        type=_chunk_size,
        default=256,
        metavar="TOKENS",
        help="Tokens per remote KV chunk (multiple of 16; default 256).",
    )
    g.add_argument(
        "--remote-kv-tail-tokens",
        dest="remote_kv_tail_tokens",
        type=_tail_tokens,
        default=None,
        metavar="TOKENS",
        help="Store and fetch the last, partial chunk of a prompt in sub-chunks of this many tokens "
        "(0 = off; default 64 when it divides the chunk size).",
    )
    g.add_argument(
        "--remote-kv-codec",
        dest="remote_kv_codec",
        type=_codec_name,
        default="default",
        metavar="NAME",
        help="Chunk codec name (see docs/CODEC.md): default (picks the near-lossless default) or one of "
        f"{', '.join(_codec_names())}.",
    )
    g.add_argument(
        "--remote-kv-auth-key-file",
        dest="remote_kv_auth_key_file",
        type=_auth_key_file,
        default="",
        metavar="PATH",
        help="Shared secret (hex or raw, >= 16 bytes): values carry a MAC bound to their key; "
        "others' writes become misses (docs/RELIABILITY.md).",
    )
    g.add_argument(
        "--remote-kv-nvdec-instances",
        dest="remote_kv_nvdec_instances",
        type=_nvdec_instances,
        default=2,
        metavar="N",
        help="Decoder instances in the NVDEC pool (--remote-kv nvdec|auto; default 2).",
    )
    g.add_argument(
        "--remote-kv-staging-tokens",
        dest="remote_kv_staging_tokens",
        type=_staging_tokens,
        default=0,
        metavar="N",
        help="Tokens of fetched KV the host staging holds until SGLang loads it (the fetch window: what "
        "waits for admission). 0 (default): half the KV pool, at most 65536 tokens. On a GPU pool the rows "
        "hold codes (about half the bytes of bf16 KV per token; /metrics: remote_kv_staging_bytes_per_token).",
    )
    g.add_argument(
        "--remote-kv-writeback-queue-mb",
        dest="remote_kv_writeback_queue_mb",
        type=_writeback_queue_mb,
        default=2048,
        metavar="MIB",
        help="KV (MiB, the pool's dtype) the write-back may hold queued; when new chunks take it past this, the "
        "oldest queued chunks are dropped (counted: writeback_skipped{reason=queue_full}); default 2048.",
    )
    g.add_argument(
        "--remote-kv-writeback-cpu",
        dest="remote_kv_writeback_cpu",
        type=_writeback_cpu,
        default=None,
        metavar="SHARE",
        help="Cores' worth of the write-back's encoding. Below 1, while the server runs batches, the encode "
        "takes at most this share of the time (its encoder process's CPU time, or its thread's wall time with "
        "--remote-kv-writeback-encoder thread; it pauses between chunks; an idle server writes back at full "
        "speed); 0: no encoding while serving. N >= 1: N encoders encode a job's chunks side by side, "
        "never pausing. Default: 0.1 where the KV pool is in host memory (the CPU platform: the encode shares "
        "the forward's cores); on a GPU a quarter of the cores (at least 1, at most 8).",
    )
    g.add_argument(
        "--remote-kv-writeback-encoder",
        dest="remote_kv_writeback_encoder",
        choices=WRITEBACK_ENCODERS,
        default="process",
        help="Where the write-back encodes KV on the host: 'process' (default): encoder processes, children "
        "of the scheduler process (niced where the KV pool is in host memory), so the encode takes neither "
        "the scheduler's GIL nor its priority; 'thread': the write-back's threads in the scheduler process. "
        "An encoder process that cannot start falls back to 'thread' (logged once with why).",
    )
    g.add_argument(
        "--remote-kv-nvdec-resolutions",
        dest="remote_kv_nvdec_resolutions",
        type=_nvdec_resolutions,
        default=None,
        metavar="LIST",
        help="NVDEC path: the video resolutions (tokens per frame: 16, 32, 64, ... below the chunk size, "
        "or full = the whole chunk on one frame) each chunk is written at and fetched from; full is "
        "always written. Default 16, a quarter (else half) chunk and full: 16,64,full for 256-token "
        "chunks. 'full' alone writes one version (no adaptive resolution).",
    )
    g.add_argument(
        "--remote-kv-nvdec-fetch",
        dest="remote_kv_nvdec_fetch",
        type=_nvdec_fetch,
        default="adaptive",
        metavar="RES",
        help="NVDEC path: adaptive (default: each chunk's resolution by KVFetcher's Alg. 1 from the "
        "measured bandwidth and decode profile) or one resolution always tried first (full, 16, ...).",
    )
    g.add_argument(
        "--remote-kv-policy-margin",
        dest="remote_kv_policy_margin",
        type=_policy_margin,
        default=1.0,
        metavar="X",
        help="Fetch when the estimated fetch time is at most X times the estimated recompute time "
        "(default 1.0; 0 = never fetch, large = always fetch when the store has the prefix).",
    )
    g.add_argument(
        "--remote-kv-layerwise",
        dest="remote_kv_layerwise",
        action="store_true",
        help="Layer-wise fetch/compute pipelining (docs/INTEGRATION.md); off by default.",
    )
    g.add_argument(
        "--remote-kv-dpu-cpus",
        dest="remote_kv_dpu_cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="Cores the DPU data plane process pins itself to (e.g. 1 or 2-3,6), emulating a DPU's "
        "own cores; default: the last quarter of the cores on >= 4-core hosts, else unpinned.",
    )
    g.add_argument(
        "--remote-kv-dpu-endpoint",
        dest="remote_kv_dpu_endpoint",
        type=_dpu_endpoint,
        default="",
        metavar="ENDPOINT",
        help="Attach to a running data-plane service (python -m sgl_remote_kv.dpu --endpoint ...) at "
        "ipc://PATH or tcp://HOST:PORT (tcp needs --remote-kv-auth-key-file, the service's secret) "
        "instead of spawning a private data plane per scheduler process; --remote-kv-dpu-cpus/-args "
        "then do not apply (the service has its own).",
    )
    g.add_argument(
        "--remote-kv-dpu-output",
        dest="remote_kv_dpu_output",
        choices=DPU_OUTPUTS,
        default="auto",
        help="What the DPU data plane writes for the KV pool: kv (it decodes the KV), codes (it only "
        "entropy-decodes; the pool's writer dequantizes / inverse-transforms, on the GPU for a GPU pool, "
        "on this process's CPU for a CPU pool), or auto (default): codes for a GPU pool, kv for a CPU "
        "pool. Codecs without a device dequant stage always fetch kv.",
    )
    g.add_argument(
        "--remote-kv-dpu-args",
        dest="remote_kv_dpu_args",
        type=_dpu_args,
        default="",
        metavar="FLAGS",
        help="Extra flags for the DPU data plane process (see python -m sgl_remote_kv.dpu --help), "
        "e.g. '--layer-group 2' or the fault injection '--dma-delay-s 0.05' (tests, benchmarks).",
    )

    g.add_argument(
        "--remote-kv-quality",
        dest="remote_kv_quality",
        choices=QUALITY_LEVELS,
        default=DEFAULT_QUALITY,
        help="Transform codec only: the quality level (a KL target in nats, from the model's calibration) "
        f"chunks are written and read at. Default {DEFAULT_QUALITY}, the near-lossless floor; a coarser "
        "level is smaller and is never chosen silently (/metrics: hit_tokens_by_quality).",
    )
    g.add_argument(
        "--remote-kv-quantizer",
        dest="remote_kv_quantizer",
        choices=QUANTIZERS,
        default=DEFAULT_QUANTIZER,
        help="Transform codec only: trellis (default; trellis-coded quantization, Deflate or zstd) or scalar "
        "(rounds each value: ~1.7x less encode CPU, ~4.5%% larger chunks at the same KL; with --remote-kv "
        "inproc it writes rANS). Its own key namespace, like a level: chunks written by a version before "
        "the trellis became the default are read with --remote-kv-quantizer scalar.",
    )
    g.add_argument(
        "--remote-kv-entropy",
        dest="remote_kv_entropy",
        choices=ENTROPIES,
        default="default",
        help="Transform codec only: its entropy stage. default: Deflate (what a DPU's engine inflates), and "
        "with --remote-kv inproc (the host entropy-decodes) zstd, or rANS with --remote-kv-quantizer scalar. "
        "zstd: ~2%% larger chunks than Deflate, entropy-decoded ~1.7x as fast on a CPU (the in-process "
        "path's remaining host work when the GPU decodes, docs/CODEC.md); rans needs the scalar quantizer. "
        "Its own key namespace, like a level.",
    )
    g.add_argument(
        "--remote-kv-flush",
        dest="remote_kv_flush",
        choices=FLUSH_SCOPES,
        default="local",
        help="What /flush_cache drops. local (default): this server's radix cache only; the remote tier "
        "keeps its chunks (shared with other servers, it survives restarts), so the next request may be "
        "a remote hit, as with SGLang's HiCache L3. tier: also retire every chunk this model has in the "
        "store (a new store generation), so the next request misses everywhere (docs/CONFORMANCE.md).",
    )


def _bounded(cast, lo, hi, multiple_of: int | None = None):
    """An argparse ``type`` parsing ``cast(text)`` within [lo, hi] (and a multiple of ``multiple_of``)."""
    what = "an integer" if cast is int else "a number"
    rule = f"a multiple of {multiple_of} in [{lo:g}, {hi:g}]" if multiple_of else f"in [{lo:g}, {hi:g}]"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not lo <= value <= hi or (multiple_of and value % multiple_of):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


_chunk_size = _bounded(int, 16, MAX_CHUNK_SIZE, multiple_of=16)
_tail_tokens = _bounded(int, 0, MAX_CHUNK_SIZE, multiple_of=16)
_nvdec_instances = _bounded(int, 1, 64)
_staging_tokens = _bounded(int, 0, 1 << 26)
_writeback_queue_mb = _bounded(int, 1, 1 << 20)
_policy_margin = _bounded(float, 0.0, 1e12)
_writeback_cpu = _bounded(float, 0.0, 64.0)


def _nvdec_resolutions(text: str) -> tuple[int, ...]:
    """``"16,64,full"`` -> (16, 64, 0) (each checked against the chunk size in the config)."""
    from sgl_remote_kv.nvdec.adapter import parse_resolution

    try:
        return tuple(parse_resolution(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nvdec_fetch(text: str) -> str:
    from sgl_remote_kv.nvdec.adapter import parse_resolution

    t = text.strip().lower()
    if t != "adaptive":
        try:
            parse_resolution(t)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"adaptive or a resolution: {e}") from None
    return t


def _dpu_args(text: str) -> str:
    """Data-plane flags, checked by parsing them into ``DataPlaneSettings`` (the data plane's own flags)."""
    import shlex

    from sgl_remote_kv.contract.settings import DataPlaneSettings

    try:
        DataPlaneSettings.from_flags(shlex.split(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _dpu_endpoint(text: str) -> str:
    if text and not is_endpoint(text):
        raise argparse.ArgumentTypeError(f"must be ipc://PATH or tcp://HOST:PORT, got {text!r}")
    return text


DEFAULT_CODEC = "default"


def _codec_names() -> list[str]:
    from sgl_remote_kv.codec.base import codec_names

    return codec_names()


def _codec_name(text: str) -> str:
    """``default`` or a name in the codec registry (``codec.base.codec_names``; checked by name only: the
    codec's module is imported when the tier starts)."""
    valid = [DEFAULT_CODEC, *_codec_names()]
    if text not in valid:
        raise argparse.ArgumentTypeError(f"unknown codec {text!r}; valid: {', '.join(valid)}")
    return text


def _store_url(text: str) -> str:
    from sgl_remote_kv.preflight import check_store_url

    try:
        return check_store_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _password_file(text: str) -> str:
    from sgl_remote_kv.store.credentials import read_password_file

    return _secret_file(text, read_password_file)


def _auth_key_file(text: str) -> str:
    from sgl_remote_kv.store.security import load_auth_key

    return _secret_file(text, load_auth_key)


def _secret_file(text: str, load) -> str:
    """``text`` ("" = none) as an absolute path once ``load`` read it without a ``ValueError``."""
    if not text:
        return ""
    from pathlib import Path

    try:
        load(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return str(Path(text).resolve())
