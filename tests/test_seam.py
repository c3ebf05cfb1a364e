"""SGLang through one seam (``sgl_remote_kv/sglang_glue/seam.py``): the product touches SGLang's internal
attributes only there, imports ``sglang.srt`` only there and in the plugin entry points, keeps an
SGLang-independent admission core, and refuses an SGLang version it was not written for."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GLUE = ROOT / "sgl_remote_kv/sglang_glue"
SHIPPED = [p for d in ("sgl_remote_kv", "dpu", "nvdec", "kernels") for p in (ROOT / d).rglob("*.py")]

# Internal attributes of SGLang's scheduler, requests, tree, pools and batches the tier relies on.
INTERNALS = {
    "origin_input_ids",
    "waiting_queue",
    "tree_cache",
    "req_to_token",
    "storage_hit_length",
    "storage_hit_start",
    "token_to_kv_pool_allocator",
    "match_prefix",
    "dp_tp_cpu_group",
    "extend_num_tokens",
    "forward_mode",
    "full_untruncated_fill_ids",
    "req_pool_idx",
    "cache_salt",
    "extra_key",
    "disaggregation_mode",
    "get_kvcache",
    "k_buffer",
    "v_buffer",
    "_add_request_to_queue",
    "tree_core",
    "server_args_class",
    "_dispatch_to_scheduler",
    "_subprocess_watchdog",
    "get_all_child_pids",
}
# Entry points: hook/registry registration, the linker (SGLang's public ``UnifiedCacheLinker``), the CPU
# platform and attention backend (which implement SGLang interfaces and
# receive its objects as arguments).
ENTRY_POINTS = {
    "plugin.py",
    "linker.py",
    "scheduler_hooks.py",
    "cpu_attention.py",
    "cpu_platform_impl.py",
}


def _attribute_uses(path: Path) -> set[str]:
    """Names used as ``.name`` in code (strings and comments skipped)."""
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    out = set()
    for a, b in zip(toks, toks[1:], strict=False):
        if a.type == tokenize.OP and a.string == "." and b.type == tokenize.NAME:
            out.add(b.string)
    return out


def test_sglang_internals_are_touched_only_in_the_seam():
    offenders = []
    for p in SHIPPED:
        if p == GLUE / "seam.py" or (p.parent == GLUE and p.name == "cpu_attention.py"):
            continue
        used = _attribute_uses(p) & INTERNALS
        if used:
            offenders.append(f"{p.relative_to(ROOT)}: {sorted(used)}")
    assert not offenders, offenders
    assert _attribute_uses(GLUE / "seam.py") >= {
        "waiting_queue",
        "origin_input_ids",
        "k_buffer",
    }  # walk works


def test_sglang_srt_is_imported_only_by_the_seam_and_the_entry_points():
    imports = re.compile(r"^\s*(from|import)\s+sglang\.srt\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for p in SHIPPED
        if imports.search(p.read_text()) and not (p.parent == GLUE and p.name in ENTRY_POINTS | {"seam.py"})
    ]
    assert not offenders, offenders


def test_the_admission_core_does_not_depend_on_sglang_or_its_glue():
    imports = re.compile(r"^\s*(from|import)\s+(sglang\b|sgl_remote_kv\.sglang_glue\b)", re.M)
    files = list((ROOT / "sgl_remote_kv/admission").glob("*.py"))
    assert len(files) >= 5
    assert not [p.name for p in files if imports.search(p.read_text())]


def test_an_sglang_version_the_seam_was_not_written_for_is_refused(monkeypatch):
    import sglang

    from sgl_remote_kv.sglang_glue import seam

    seam.check_version()  # the installed one
    monkeypatch.setattr(sglang, "__version__", "0.6.0")
    with pytest.raises(seam.UnsupportedSGLang, match="0.5.23.*0.6.0"):
        seam.check_version()
    monkeypatch.setenv("SRKV_ALLOW_SGLANG_VERSION", "1")
    seam.check_version()  # the operator's override: a warning only


def test_a_cache_without_kv_allocator_runs_without_the_tier(monkeypatch, caplog):
    """SGLang's own disabled-cache kit case (``sglang/test/kits/unified_radix_cache/core.py``: no KV
    allocator) given to our linker with the tier on: the linker is built, the tier stays off with one
    warning and every lookup misses, no crash."""
    import logging
    import types

    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.test.kits.unified_radix_cache.core import DisabledUnifiedRadixCacheFixtures

    from sgl_remote_kv import runtime
    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.sglang_glue import linker

    params = DisabledUnifiedRadixCacheFixtures()._params(disable=True)  # the kit's own: no allocator
    assert params.token_to_kv_pool_allocator is None
    monkeypatch.setattr(RemoteKVConfig, "current", classmethod(lambda cls: RemoteKVConfig(mode="dpu")))
    monkeypatch.setattr(runtime, "_RUNTIME", None)
    server_args = types.SimpleNamespace(model_path="unused", trust_remote_code=False)
    with caplog.at_level(logging.WARNING, logger=linker.__name__):
        ln = linker.RemoteKVLinker(
            server_args, params, components=set(), extra_config={}, forward_stream=None
        )
    assert runtime.get() is None and ln.staged is None
    assert [r.getMessage() for r in caplog.records] == [
        "remote KV tier disabled: the cache has no KV allocator"
    ]
    assert ln.lookup("r", [PoolTransfer(name=PoolName.KV, keys=["a"])]) == []
