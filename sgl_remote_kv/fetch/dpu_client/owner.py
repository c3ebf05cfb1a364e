"""The DPU client's configuration (``DpuClientConfig``) and what its receiver and supervisor threads read of
the ``DpuClient`` that owns them (``ClientState``). Apart from ``client.py``, so that the modules of those
threads type against the client without importing it (no import cycle within ``fetch/dpu_client``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sgl_remote_kv.contract.endpoints import check_endpoint
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import DEST_SLOT_BYTES
from sgl_remote_kv.types import DPU_OUTPUTS, ModelFingerprint

from .round_io import RoundIO
from .rounds import RoundBook


@dataclass(frozen=True)
class DpuClientConfig:
    store_url: str
    dest_slots: int = 2
    dest_slot_bytes: int = DEST_SLOT_BYTES
    blob_slot_bytes: int = 0  # > 0: host-visible copies of verified blobs (layer-wise admission)
    process: DataPlaneSettings = DataPlaneSettings()
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    job_timeout_s: float = 30.0  # an in-flight round with no event for this long: data plane hung
    start_timeout_s: float = 60.0
    endpoint: str = ""  # "": spawn a private data plane; else attach to the service there (ipc:// or tcp://)
    auth_key_file: str = ""  # shared secret of an attached service's endpoint (CURVE); required for tcp://
    # write each run of finished layers into the rows as soon as every chunk of the round has it (always
    # with a blob area); False: one write per host round once all its layers arrived (fewer device launches)
    eager_writes: bool = True
    # what the data plane writes for the target's writer: "kv" (decoded KV), "codes" (the lossless stage's
    # output, dequantized by the writer: ``KVWriter.write_quantized``), or "auto": codes where the writer
    # dequantizes on a device (``KVWriter.device_dequant``: a GPU pool), KV otherwise. Codes only for codecs
    # with a device dequant stage; other codecs always fetch KV.
    output: str = "auto"

    def __post_init__(self) -> None:
        if self.output not in DPU_OUTPUTS:
            raise ValueError(f"data-plane output must be one of {DPU_OUTPUTS}, got {self.output!r}")
        if self.endpoint:
            check_endpoint(
                self.endpoint,
                authenticated=bool(self.auth_key_file),
                what="data-plane endpoint",
                key_hint="an auth key file (--remote-kv-auth-key-file)",
            )


class ClientState(Protocol):
    """The client's state the receiver and the supervisor use (all of it guarded by ``cv`` where mutable)."""

    cfg: DpuClientConfig
    cv: threading.Condition
    book: RoundBook
    io: RoundIO
    codec: object
    fingerprint: ModelFingerprint
    counters: dict[str, float]
    on_event: Callable | None
    on_store_error: Callable | None
