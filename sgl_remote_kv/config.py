"""Configuration: one frozen dataclass, parsed once at the edge (CLI flags) and shipped as JSON.

``RemoteKVConfig.add_cli_args`` adds our flags to SGLang's argparse parser; ``from_namespace`` turns the
parsed namespace into the config (errors are ``argparse.ArgumentTypeError`` naming the flag, so argparse
prints one clear message). The launcher exports the config as JSON (``env.publish_config_json``); the
scheduler processes read it back with ``RemoteKVConfig.current()``.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, fields

from sgl_remote_kv import env
from sgl_remote_kv.contract.endpoints import check_endpoint
from sgl_remote_kv.contract.settings import MAX_CPUS
from sgl_remote_kv.flags import (
    DEFAULT_TAIL_TOKENS,
    FLUSH_SCOPES,
    MAX_CHUNK_SIZE,
    MODES,
    add_flags,
)
from sgl_remote_kv.types import (
    DEFAULT_QUALITY,
    DEFAULT_QUANTIZER,
    DPU_OUTPUTS,
    ENTROPIES,
    QUALITY_LEVELS,
    QUANTIZERS,
    SCALAR_QUANTIZER,
    WRITEBACK_ENCODERS,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteKVConfig:
    mode: str = "off"
    store_url: str = ""  # "" -> the embedded local store under env.cache_dir()/store
    chunk_size: int = 256
    tail_tokens: int | None = None  # tail sub-chunk size; None = 64 where it divides a larger chunk, 0 = off
    codec: str = "default"
    quality: str = DEFAULT_QUALITY  # transform codec: the KL target of its calibration level
    quantizer: str = DEFAULT_QUANTIZER  # transform codec: "scalar" (rint) or "trellis" (Deflate or zstd)
    entropy: str = "default"  # transform codec's entropy stage (types.ENTROPIES); default: by mode (paths.py)
    auth_key_file: str = ""  # "" -> values are not authenticated (see sgl_remote_kv/store/security.py)
    store_password_file: str = ""  # the Redis store's password, in a file (store/credentials.py)
    nvdec_instances: int = 2  # decoder instances of the NVDEC pool (--remote-kv nvdec|auto)
    staging_tokens: int = 0  # host staging rows (tokens); 0 = half the KV pool, at most STAGING_AUTO_MAX
    writeback_queue_mb: int = 2048  # KV the write-back may hold queued; past it the oldest jobs are dropped
    # the write-back worker's busy share of wall time while the server serves; None: WRITEBACK_CPU_HOST_POOL
    # where the KV pool is in host memory (its encode shares the forward's cores), else 1 (no pause)
    writeback_cpu: float | None = None
    writeback_encoder: str = "process"  # where a host encode runs: encoder processes, or the worker's threads
    # hevc versions written and fetched, tokens per frame (0 = "full", the anchor, always included);
    # None = 16, chunk/4 (else chunk/2) and full where they fit (docs/NVDEC.md "Adaptive resolution")
    nvdec_resolutions: tuple[int, ...] | None = None
    nvdec_fetch: str = "adaptive"  # "adaptive" (Alg. 1) or one resolution tried first ("full", "16", ...)
    layerwise: bool = False  # admit fully fetched requests before every layer is in the pool
    policy_margin: float = 1.0  # fetch when est. fetch time <= margin x est. recompute time
    dpu_cpus: tuple[int, ...] = ()  # cores the DPU data plane pins itself to; () = automatic
    dpu_args: str = ""  # extra data-plane command-line flags (tests, benchmarks; shlex-split)
    dpu_endpoint: str = ""  # "": spawn a private data plane; else attach to the data-plane service there
    dpu_output: str = "auto"  # what the data plane writes for the pool: kv, codes, auto (codes on a GPU pool)
    flush: str = "local"  # what /flush_cache drops: "local" (this server's cache) or also the "tier"'s chunks

    def __post_init__(self) -> None:
        object.__setattr__(self, "dpu_cpus", tuple(self.dpu_cpus))  # JSON round trip gives a list
        if self.nvdec_resolutions is not None:
            object.__setattr__(self, "nvdec_resolutions", tuple(self.nvdec_resolutions))
        if any(not isinstance(c, int) or not 0 <= c < MAX_CPUS for c in self.dpu_cpus):
            raise ValueError(f"--remote-kv-dpu-cpus must be core ids in [0, {MAX_CPUS}), got {self.dpu_cpus}")
        if self.mode not in MODES:
            raise ValueError(f"--remote-kv must be one of {MODES}, got {self.mode!r}")
        if not 16 <= self.chunk_size <= MAX_CHUNK_SIZE or self.chunk_size % 16:
            raise ValueError(
                f"--remote-kv-chunk-size must be a multiple of 16 in [16, {MAX_CHUNK_SIZE}], got {self.chunk_size}"
            )
        t = self.tail_tokens
        if (
            t is not None
            and t != 0
            and not (16 <= t < self.chunk_size and t % 16 == 0 and self.chunk_size % t == 0)
        ):
            raise ValueError(
                f"--remote-kv-tail-tokens must be 0 or a multiple of 16 that divides a larger chunk size "
                f"({self.chunk_size}), got {t}"
            )
        if not 0.0 <= self.policy_margin <= 1e12:
            raise ValueError(f"--remote-kv-policy-margin must be in [0, 1e12], got {self.policy_margin}")
        if self.quality not in QUALITY_LEVELS:
            raise ValueError(f"--remote-kv-quality must be one of {QUALITY_LEVELS}, got {self.quality!r}")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"--remote-kv-quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        if self.entropy not in ENTROPIES:
            raise ValueError(f"--remote-kv-entropy must be one of {ENTROPIES}, got {self.entropy!r}")
        if self.entropy == "rans" and self.quantizer != SCALAR_QUANTIZER:
            raise ValueError(
                "--remote-kv-entropy rans needs --remote-kv-quantizer scalar (its tables fit those)"
            )
        if self.flush not in FLUSH_SCOPES:
            raise ValueError(f"--remote-kv-flush must be one of {FLUSH_SCOPES}, got {self.flush!r}")
        if self.dpu_endpoint:
            check_endpoint(
                self.dpu_endpoint,
                authenticated=bool(self.auth_key_file),
                what="--remote-kv-dpu-endpoint",
                key_hint="--remote-kv-auth-key-file (the endpoint's CURVE keys are derived from that secret)",
            )
        if self.store_password_file:
            from sgl_remote_kv.store.credentials import with_password_file

            try:
                with_password_file(self.store_url, self.store_password_file)
            except ValueError as e:
                raise ValueError(f"--remote-kv-store-password-file: {e}") from None
        if self.dpu_output not in DPU_OUTPUTS:
            raise ValueError(f"--remote-kv-dpu-output must be one of {DPU_OUTPUTS}, got {self.dpu_output!r}")
        if not 0 <= self.staging_tokens <= 1 << 26:
            raise ValueError(
                f"--remote-kv-staging-tokens must be in [0, {1 << 26}], got {self.staging_tokens}"
            )
        if not 1 <= self.writeback_queue_mb <= 1 << 20:
            raise ValueError(
                f"--remote-kv-writeback-queue-mb must be in [1, {1 << 20}], got {self.writeback_queue_mb}"
            )
        if self.writeback_cpu is not None and not 0.0 <= self.writeback_cpu <= 64.0:
            raise ValueError(f"--remote-kv-writeback-cpu must be in [0, 64], got {self.writeback_cpu}")
        if self.writeback_encoder not in WRITEBACK_ENCODERS:
            raise ValueError(
                f"--remote-kv-writeback-encoder must be one of {WRITEBACK_ENCODERS}, got {self.writeback_encoder!r}"
            )
        if not 1 <= self.nvdec_instances <= 64:
            raise ValueError(f"--remote-kv-nvdec-instances must be in [1, 64], got {self.nvdec_instances}")
        try:
            versions = self.nvdec_versions
        except ValueError as e:
            raise ValueError(f"--remote-kv-nvdec-resolutions: {e}") from None
        if self.nvdec_fetch != "adaptive":
            from sgl_remote_kv.nvdec.adapter import parse_resolution

            try:
                fixed = parse_resolution(self.nvdec_fetch)
            except ValueError as e:
                raise ValueError(f"--remote-kv-nvdec-fetch: {e}") from None
            if fixed not in versions:
                raise ValueError(
                    f"--remote-kv-nvdec-fetch {self.nvdec_fetch} is not one of the resolutions {versions}"
                )

    @property
    def nvdec_versions(self) -> tuple[int, ...]:
        """The hevc resolutions (tokens per frame; 0 = full) this server writes and fetches, sorted."""
        from sgl_remote_kv.nvdec.adapter import check_resolutions

        if self.nvdec_resolutions is None:  # 16 and a quarter (else half) of the chunk, where they fit
            c, picked = self.chunk_size, []
            for r in (16, c // 4, c // 2):
                if 16 <= r < c and r & (r - 1) == 0 and c % r == 0 and r not in picked and len(picked) < 2:
                    picked.append(r)
            return check_resolutions(picked, c)
        return check_resolutions(self.nvdec_resolutions, self.chunk_size)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def tail_granule(self) -> int:
        """Tokens per tail sub-chunk (0: only full chunks are stored). The default is 64 where 64 divides
        a larger chunk size, else off."""
        if self.tail_tokens is not None:
            return self.tail_tokens
        return (
            DEFAULT_TAIL_TOKENS if self.chunk_size > DEFAULT_TAIL_TOKENS and self.chunk_size % 64 == 0 else 0
        )

    def resolved_store_url(self) -> str:
        url = self.store_url or f"file://{env.cache_dir() / 'store'}"
        if self.store_password_file:
            from sgl_remote_kv.store.credentials import with_password_file

            url = with_password_file(url, self.store_password_file)
        if self.auth_key_file:
            from sgl_remote_kv.store.security import auth_store_url

            url = auth_store_url(url, self.auth_key_file)
        return url

    # --- serialisation (JSON only) ---
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, payload: str) -> RemoteKVConfig:
        raw = json.loads(payload)
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown remote-kv config keys: {sorted(unknown)}")
        return cls(**raw)

    @classmethod
    def current(cls) -> RemoteKVConfig:
        """The config exported by the launcher, or the default (off) when none was exported."""
        payload = env.config_json()
        return cls.from_json(payload) if payload else cls()

    def publish(self) -> None:
        """Export this config to the processes started after it (``current`` reads it back), with one
        INFO line."""
        from sgl_remote_kv.store.base import redact_url

        env.publish_config_json(self.to_json())
        logger.info(
            "sgl-remote-kv: --remote-kv %s (store %s, chunk %d tokens, codec %s)",
            self.mode,
            redact_url(self.resolved_store_url()),
            self.chunk_size,
            self.codec,
        )

    # --- CLI edge ---
    add_cli_args = staticmethod(add_flags)  # the flags: flags.py

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> RemoteKVConfig:
        """``sglang.Engine(remote_kv="dpu", remote_kv_store=...)``: the keyword arguments named like the
        flags' destinations, parsed by the same argparse rules as the CLI (same validation, same errors,
        as ``ValueError``). ``True`` stands for a flag without a value; ``False`` / ``None`` for absent."""
        parser = argparse.ArgumentParser(prog="sglang.Engine", add_help=False, exit_on_error=False)
        cls.add_cli_args(parser)
        flags = {a.dest: a for a in parser._actions if a.dest.startswith("remote_kv")}
        argv: list[str] = []
        for key, value in kwargs.items():
            action = flags.get(key)
            if action is None:
                raise ValueError(f"unknown remote-kv option {key}=...; known: {sorted(flags)}")
            if value is None or value is False:
                continue
            argv.append(action.option_strings[0])
            if action.nargs != 0:  # not a store_true flag
                argv.append(",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
        try:
            ns = parser.parse_args(argv)
        except argparse.ArgumentError as e:
            raise ValueError(str(e)) from None
        return cls.from_namespace(ns, on_command_line=False)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, on_command_line: bool = True) -> RemoteKVConfig:
        """The config of parsed flags; ``on_command_line``: they came from a command line (``ps`` shows it)."""
        cfg = cls._from_namespace(ns)
        if cfg.enabled and on_command_line:
            from sgl_remote_kv.store.credentials import url_password_warning

            warning = url_password_warning(cfg.store_url)
            if warning:
                logger.warning(warning)
        if cfg.enabled and getattr(ns, "remote_kv_probe_store", True):
            from sgl_remote_kv.preflight import probe_store_async

            probe_store_async(cfg.resolved_store_url())  # one warning if unreachable; never blocks
        return cfg

    @classmethod
    def _from_namespace(cls, ns: argparse.Namespace) -> RemoteKVConfig:
        return cls(
            mode=ns.remote_kv,
            store_url=ns.remote_kv_store,
            chunk_size=ns.remote_kv_chunk_size,
            tail_tokens=getattr(ns, "remote_kv_tail_tokens", None),
            codec=ns.remote_kv_codec,
            quality=getattr(ns, "remote_kv_quality", DEFAULT_QUALITY),
            quantizer=getattr(ns, "remote_kv_quantizer", DEFAULT_QUANTIZER),
            entropy=getattr(ns, "remote_kv_entropy", "default"),
            auth_key_file=getattr(ns, "remote_kv_auth_key_file", ""),
            store_password_file=getattr(ns, "remote_kv_store_password_file", ""),
            nvdec_instances=getattr(ns, "remote_kv_nvdec_instances", 2),
            staging_tokens=getattr(ns, "remote_kv_staging_tokens", 0),
            writeback_queue_mb=getattr(ns, "remote_kv_writeback_queue_mb", 2048),
            writeback_cpu=getattr(ns, "remote_kv_writeback_cpu", None),
            writeback_encoder=getattr(ns, "remote_kv_writeback_encoder", "process"),
            nvdec_resolutions=getattr(ns, "remote_kv_nvdec_resolutions", None),
            nvdec_fetch=getattr(ns, "remote_kv_nvdec_fetch", "adaptive"),
            layerwise=getattr(ns, "remote_kv_layerwise", False),
            policy_margin=getattr(ns, "remote_kv_policy_margin", 1.0),
            dpu_cpus=getattr(ns, "remote_kv_dpu_cpus", ()),
            dpu_args=getattr(ns, "remote_kv_dpu_args", ""),
            dpu_endpoint=getattr(ns, "remote_kv_dpu_endpoint", ""),
            dpu_output=getattr(ns, "remote_kv_dpu_output", "auto"),
            flush=getattr(ns, "remote_kv_flush", "local"),
        )


def configure(**options) -> RemoteKVConfig:
    """The offline ``sglang.Engine``'s way to turn the tier on: call before constructing the Engine, with
    the flags' destinations as keywords (``remote_kv="dpu"``, ``remote_kv_store="redis://..."``,
    ``remote_kv_chunk_size=256``, ...). Same validation and errors as the CLI (``ValueError``); the
    config applies to every Engine this process starts afterwards (``remote_kv="off"`` turns it off)."""
    cfg = RemoteKVConfig.from_kwargs(options)
    cfg.publish()
    return cfg
