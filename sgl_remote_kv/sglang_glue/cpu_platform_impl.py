"""The CPU development platform class (imported only when the plugin is active)."""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform


class CpuDevPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device, native torch forwards for every op, ``cpu_prefix`` attention, no graphs.

    ``cpu_prefix`` (``sgl_remote_kv.sglang_glue.cpu_attention``) is ``torch_native`` with
    extend attention computed for the new tokens only; the general plugin registers it.
    """

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        from sgl_remote_kv.sglang_glue.cpu_attention import BACKEND_NAME

        return BACKEND_NAME

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_graph_runner_cls(self):
        return None
