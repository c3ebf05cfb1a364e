"""Adaptive resolution for the simulation benchmark (``benchmarks/nvdec_sim.py``, ``bench_nvdec``).

Alg. 1 and its table now live in the package, where the serving path uses them: ``nvdec/adapter.py``
(``ProfileTable``, ``choose``, ``BandwidthEstimator``, ``ResolutionAdapter``) and ``nvdec/profile.py``
(``profile``, ``load_or_profile``, the cache file). This module re-exports them under the names the
simulation and its tests always used; the real-server benchmark is ``bench_adaptive_resolution.py``.
"""

from __future__ import annotations

from sgl_remote_kv.nvdec.adapter import OBJECTIVES, BandwidthEstimator, Choice, ProfileTable, choose, rank
from sgl_remote_kv.nvdec.profile import default_path, load_or_profile, profile, table_key

__all__ = [
    "OBJECTIVES",
    "BandwidthEstimator",
    "Choice",
    "ProfileTable",
    "choose",
    "default_path",
    "load_or_profile",
    "profile",
    "rank",
    "table_key",
]
