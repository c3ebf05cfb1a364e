"""The CPU development platform class (imported only when the plugin is active)."""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform


class CpuDevPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device, native torch forwards for every op, ``torch_native`` attention, no graphs."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_graph_runner_cls(self):
        return None
