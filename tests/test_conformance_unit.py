"""SGLang's own unit kit for ``UnifiedRadixCache`` (``sglang/test/kits/unified_radix_cache``, imported
from the installed SGLang, nothing copied) run with our linker attached.

The kit ships fixtures, not test bodies: ``build_fixture`` (pools, allocator, tree for each of the kit's
``CONFIGS``: full attention at page sizes 1-128, Mamba and SWA hybrids) and the step mixin
``UnifiedRadixCacheFixtures`` (insert, in-flight requests, HiCache backup, load-back, eviction). The
scenarios below use only those steps and run, for every kit config, on two caches:

- ``sglang``: the kit's own ``UnifiedRadixCache`` (the baseline; a scenario must pass here first);
- ``linker``: the same cache with ``RemoteKVLinker`` attached the way SGLang's factory attaches a linker
  (``init_cache_linker``, its layer counter registered on the pool), the tier on (``inproc`` path,
  embedded store in a tmp dir). On the full-attention configs the runtime is built over the kit's pool,
  finished requests are written back (the checkpoint hook), and a second cache built over the same store
  (a restart) finds them; on hybrid configs (Mamba, SWA) the tier stays off with one warning
  (``seam.UnsupportedPool``), and the cache must still behave.

``build_fixture`` constructs ``UnifiedRadixCache(params=...)`` itself; for the linker variant that name is
patched, for the duration of one build, to a callable that builds the cache and attaches the linker. The
kit has no model directory: the linker's model config is a stand-in (``AutoConfig`` patched).
"""

from __future__ import annotations

import contextlib
import logging
import types
import unittest
from unittest import mock

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
from sglang.test.kits.unified_radix_cache.config import CONFIGS, supports_hicache
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix, node_device_value
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures
from sglang.test.mem_cache_utils import finish_req

from sgl_remote_kv import runtime
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.sglang_glue import linker, scheduler_hooks

VARIANTS = ("sglang", "linker")
CHUNK = 128  # a multiple of every kit page size


def _full_only(cfg) -> bool:
    return cfg.components == (ComponentType.FULL,)


class _Variant:
    """Builds the kit's fixtures with one of ``VARIANTS``; owns the runtimes it publishes."""

    def __init__(self, name: str, store_dir: str) -> None:
        self.name, self.store_dir = name, store_dir
        self.runtimes: list = []
        self.warnings: list[str] = []

    def config(self) -> RemoteKVConfig:
        return RemoteKVConfig(
            mode="inproc",
            store_url=f"file://{self.store_dir}",
            chunk_size=CHUNK,
            codec="lossless",
            tail_tokens=0,
            policy_margin=1e9,
        )

    def _with_linker(self, params):
        cache = UnifiedRadixCache(params)
        runtime._RUNTIME = None
        handler = _Capture(self.warnings)
        logging.getLogger(linker.__name__).addHandler(handler)
        hf = types.SimpleNamespace(architectures=["KitModel"])
        server_args = types.SimpleNamespace(model_path="kit-model", trust_remote_code=False)
        try:
            with (
                mock.patch.object(RemoteKVConfig, "current", classmethod(lambda cls: self.config())),
                mock.patch("transformers.AutoConfig.from_pretrained", return_value=hf),
            ):
                ours = linker.RemoteKVLinker(
                    server_args,
                    params,
                    components=set(cache.components),
                    extra_config={},
                    forward_stream=None,
                )
        finally:
            logging.getLogger(linker.__name__).removeHandler(handler)
        cache.init_cache_linker(ours)
        params.token_to_kv_pool_allocator.get_kvcache().register_layer_transfer_counter(
            ours.layer_done_counter
        )
        if runtime.get() is not None:
            self.runtimes.append(runtime.get())
        return cache

    def build(self, cfg):
        if self.name == "sglang":
            return build_fixture(cfg)
        with mock.patch.object(kit_fixtures, "UnifiedRadixCache", lambda params: self._with_linker(params)):
            return build_fixture(cfg)

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()
        runtime._RUNTIME = None


class _Capture(logging.Handler):
    def __init__(self, out: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage())


class TierScenarios(UnifiedRadixCacheFixtures):
    """Scenarios over the kit's steps; ``cfg`` and ``variant`` are bound per generated class."""

    variant: str

    def setUp(self) -> None:
        self._tmp = contextlib.ExitStack()
        import tempfile

        self.v = _Variant(self.variant, self._tmp.enter_context(tempfile.TemporaryDirectory()))
        self.addCleanup(self._tmp.close)
        self.addCleanup(self.v.close)
        # The write-back's AFTER hook on ``UnifiedRadixCache.checkpoint``, as the plugin has SGLang apply it
        # in a server (HookRegistry: the original, then the hook with its result).
        original = UnifiedRadixCache.checkpoint

        def hooked(cache, req, *args, **kwargs):
            return scheduler_hooks.after_checkpoint(
                original(cache, req, *args, **kwargs), cache, req, *args, **kwargs
            )

        self._tmp.enter_context(mock.patch.object(UnifiedRadixCache, "checkpoint", hooked))
        # This machine has no accelerator: the kit's pools live on the CPU, for every variant alike.
        self._tmp.enter_context(mock.patch.object(kit_fixtures, "get_device", lambda: "cpu"))

    def _fixture(self):
        cache, allocator, rtp = self.v.build(self.cfg)
        if self.variant == "linker":
            self.assertIsInstance(cache.linker.cache_linker, linker.RemoteKVLinker)
            if _full_only(self.cfg):
                self.assertIsNotNone(runtime.get(), self.v.warnings)
            else:  # hybrid pools: one clear warning, the tier off, the cache unchanged
                self.assertIsNone(runtime.get())
                self.assertEqual(len(self.v.warnings), 1, self.v.warnings)
                self.assertIn("remote KV tier disabled", self.v.warnings[0])
        return cache, allocator, rtp

    def _insert(self, cache, *args, **kwargs):
        out = super()._insert(cache, *args, **kwargs)
        if self.variant == "linker":
            # what the scheduler runs every step: the linker's offload of the inserted nodes (it completes
            # at once; the write-back stores) is committed and the nodes' offload locks released
            cache.check_hicache_events()
        return out

    def _seq(self, start: int, pages: int) -> list[int]:
        return self._make_seq(start, pages)

    def _skip_mamba(self) -> None:
        if self.cfg.has_mamba:
            self.skipTest(
                "Mamba stacks match only at state checkpoints; this scenario asserts full-prefix matches"
            )

    def test_insert_split_and_match(self):
        self._skip_mamba()
        cache, allocator, rtp = self._fixture()
        a = self._seq(100, 4)
        b = a[: 2 * self.cfg.page_size] + self._seq(5000, 2)
        self._insert(cache, allocator, rtp, a)
        self._insert(cache, allocator, rtp, b)
        self.assertEqual(match_prefix(cache, a).device_prefix_len, len(a))
        self.assertEqual(match_prefix(cache, b).device_prefix_len, len(b))
        other = self._seq(9000, 2)
        self.assertEqual(match_prefix(cache, other).device_prefix_len, 0)
        shared = a[: 2 * self.cfg.page_size] + self._seq(7000, 1)
        self.assertEqual(match_prefix(cache, shared).device_prefix_len, 2 * self.cfg.page_size)

    def test_finished_request_is_cached_and_written_back(self):
        self._skip_mamba()
        cache, allocator, rtp = self._fixture()
        ids = self._seq(300, max(1, 2 * CHUNK // self.cfg.page_size))
        req, _slots = self._make_inflight_req(cache, allocator, rtp, ids[:-1], ids[-1:])
        finish_req(cache, req, up_to=len(ids))
        self.assertEqual(match_prefix(cache, ids).device_prefix_len, len(ids))
        rt = runtime.get()
        if self.variant != "linker" or rt is None:
            return
        cache.reset()  # what /flush_cache runs: the tree is emptied, the queued write-back lands first
        self.assertEqual(match_prefix(cache, ids).device_prefix_len, 0)
        keys = rt.keys.keys_for(ids, len(ids) // CHUNK, None)
        self.assertEqual(rt.client.count_prefix(keys), len(keys))
        # A restart: a new cache over the same store finds the chunks (the admission queue fetches them).
        self.v.build(self.cfg)
        self.assertIsNot(runtime.get(), rt)
        self.assertEqual(runtime.get().client.count_prefix(keys), len(keys))

    def test_evict_frees_slots_and_shortens_match(self):
        cache, allocator, rtp = self._fixture()
        self.assertEqual(cache.supports_mamba(), self.cfg.has_mamba)
        self.assertEqual(cache.supports_swa(), self.cfg.has_swa)
        ids = self._seq(400, 4)
        before = allocator.available_size()
        self._insert(cache, allocator, rtp, ids)
        self.assertEqual(allocator.available_size(), before - len(ids))
        cache.evict(EvictParams(num_tokens=len(ids)))
        self.assertEqual(allocator.available_size(), before)
        self.assertEqual(match_prefix(cache, ids).device_prefix_len, 0)

    def test_hicache_backup_evict_load_back(self):
        if not supports_hicache(self.cfg) or not _full_only(self.cfg):
            self.skipTest("the kit's HiCache steps are exercised on its full-attention configs here")
        if not torch.cuda.is_available():
            self.skipTest("the kit's HiCache steps need CUDA (host-device copies on CUDA streams)")
        cache, allocator, rtp = self._fixture()
        self._init_hicache(cache)
        ids = self._seq(600, 2)
        self._insert(cache, allocator, rtp, ids)
        node = match_prefix(cache, ids).last_device_node
        slots = node_device_value(cache, node, ComponentType.FULL)
        self._fill_full_kv(allocator, slots, 3.0)
        self._backup_node(cache, node)
        self._evict_device_component(cache, node, ComponentType.FULL)
        self.assertIsNone(node_device_value(cache, node, ComponentType.FULL))
        loaded = self._load_back_node(cache, node)
        k, v = self._snapshot_full_kv(allocator, loaded)
        self.assertTrue(bool((k == 3.0).all()) and bool((v == 4.0).all()))
        self.assertEqual(match_prefix(cache, ids).device_prefix_len, len(ids))


def _classes():
    for cfg in CONFIGS:
        for variant in VARIANTS:
            name = f"Test_{variant}_{cfg.label}"
            cls = type(name, (TierScenarios, unittest.TestCase), {"cfg": cfg, "variant": variant})
            cls.__module__ = __name__
            yield name, cls


globals().update(dict(_classes()))
