"""What one data-plane process serves: ``DataPlaneConfig``, built once at the CLI edge (``__main__``) and
read, never changed, by the server thread (``server.py``) and its tables (``clients.py``, ``jobs.py``).
Its tunables are ``settings.DataPlaneSettings``; nothing here reads the environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.endpoints import check_endpoint
from sgl_remote_kv.contract.settings import DataPlaneSettings


@dataclass(frozen=True)
class DataPlaneConfig:
    """Where this data plane serves and for whom, plus its ``DataPlaneSettings``; built once at the CLI
    edge (``__main__``). ``auth_key``: the shared secret; the endpoint then speaks CURVE with keys derived
    from it (``auth.py``); a ``tcp://`` endpoint without one is refused."""

    endpoint: str
    store_url: str
    settings: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    max_jobs: int = 1024
    max_active_chunks: int = 1 << 16  # over all active jobs: bounds the job table's memory
    parent_pid: int = 0  # when set, exit as soon as this process is no longer our parent
    warm: P.Warmup | None = None  # decoded once before serving (``DataPlaneServer.warm_up``)
    auth_key: bytes = field(default=b"", repr=False)
    client_timeout_s: float = 10.0  # drop a registered client silent this long; 0: never (spawned child)
    max_clients: int = 256
    allowed_fingerprints: tuple[bytes, ...] = ()  # model digests this service accepts; (): any
    # regions our spawning host passed down as descriptors (name, fd): anonymous memory, no name to attach
    inherited_regions: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        check_endpoint(
            self.endpoint, authenticated=bool(self.auth_key), what="endpoint", key_hint="--auth-key-file"
        )
        if not 0 <= self.client_timeout_s <= 3600:
            raise ValueError("client_timeout_s must be in [0, 3600]")
