import argparse
import json

import pytest

from sgl_remote_kv import env
from sgl_remote_kv.config import RemoteKVConfig


def _parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    RemoteKVConfig.add_cli_args(p)
    return p


def test_defaults_are_off_and_embedded_store(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    cfg = RemoteKVConfig.from_namespace(_parser().parse_args([]))
    assert cfg == RemoteKVConfig()
    assert not cfg.enabled
    assert cfg.resolved_store_url() == f"file://{tmp_path / 'store'}"


def test_flags_parse_into_frozen_config():
    ns = _parser().parse_args(
        ["--remote-kv", "dpu", "--remote-kv-store", "redis://h:1/0", "--remote-kv-chunk-size", "512"]
    )
    cfg = RemoteKVConfig.from_namespace(ns)
    assert (cfg.mode, cfg.store_url, cfg.chunk_size) == ("dpu", "redis://h:1/0", 512)
    with pytest.raises(AttributeError):
        cfg.mode = "off"  # frozen


@pytest.mark.parametrize(
    "argv",
    [
        ["--remote-kv", "gpu"],
        ["--remote-kv-chunk-size", "100"],
        ["--remote-kv-chunk-size", "abc"],
        ["--remote-kv-chunk-size", "0"],
        ["--remote-kv-flush", "everything"],
        ["--remote-kv-dpu-output", "symbols"],
        ["--remote-kv-codec", "bogus"],
    ],
)
def test_bad_values_are_argparse_errors_naming_the_flag(argv, capsys):
    p = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_an_unknown_codec_fails_at_parse_time_with_one_line_listing_the_valid_names(capsys):
    """``--remote-kv-codec bogus`` used to pass the flags, load the model and die in the scheduler
    (``KeyError``); now argparse refuses it at once, naming every valid codec (the registry's)."""
    from sgl_remote_kv.codec.base import codec_names

    p = argparse.ArgumentParser(prog="sglang.launch_server")
    RemoteKVConfig.add_cli_args(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--remote-kv", "inproc", "--remote-kv-codec", "bogus"])
    assert e.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert "--remote-kv-codec" in line and "unknown codec 'bogus'" in line, line
    valid = line.split("valid: ", 1)[1].split(", ")
    assert valid == ["default", *codec_names()] and "lossless" in valid and "transform" in valid
    for name in ("default", *codec_names()):  # every valid name parses
        assert RemoteKVConfig.from_namespace(_parser().parse_args(["--remote-kv-codec", name])).codec == name
    with pytest.raises(ValueError, match="unknown codec 'bogus'; valid: default, "):  # sglang.Engine(...)
        RemoteKVConfig.from_kwargs({"remote_kv": "inproc", "remote_kv_codec": "bogus"})


def test_json_round_trip_and_export(monkeypatch):
    cfg = RemoteKVConfig(mode="auto", store_url="file:///x", chunk_size=128, codec="lossless")
    assert RemoteKVConfig.from_json(cfg.to_json()) == cfg
    monkeypatch.setenv(env.CONFIG_JSON, cfg.to_json())
    assert RemoteKVConfig.current() == cfg


def test_json_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown"):
        RemoteKVConfig.from_json(json.dumps({"mode": "dpu", "evil": 1}))
    with pytest.raises(ValueError, match="--remote-kv-flush"):
        RemoteKVConfig.from_json(json.dumps({"mode": "dpu", "flush": "all"}))
    with pytest.raises(ValueError, match="--remote-kv-dpu-output"):
        RemoteKVConfig.from_json(json.dumps({"mode": "dpu", "dpu_output": "symbols"}))


def test_writeback_encoder_flag():
    assert (
        RemoteKVConfig.from_namespace(_parser().parse_args(["--remote-kv", "dpu"])).writeback_encoder
        == "process"
    )
    ns = _parser().parse_args(["--remote-kv", "dpu", "--remote-kv-writeback-encoder", "thread"])
    assert RemoteKVConfig.from_namespace(ns).writeback_encoder == "thread"
    with pytest.raises(ValueError, match="--remote-kv-writeback-encoder must be one of"):
        RemoteKVConfig(mode="dpu", writeback_encoder="gpu")


def test_dpu_output_flag():
    assert RemoteKVConfig.from_namespace(_parser().parse_args(["--remote-kv", "dpu"])).dpu_output == "auto"
    ns = _parser().parse_args(["--remote-kv", "dpu", "--remote-kv-dpu-output", "codes"])
    assert RemoteKVConfig.from_namespace(ns).dpu_output == "codes"


def test_flush_scope_flag():
    assert RemoteKVConfig.from_namespace(_parser().parse_args(["--remote-kv", "dpu"])).flush == "local"
    ns = _parser().parse_args(
        ["--remote-kv", "dpu", "--remote-kv-flush", "tier", "--remote-kv-store", "file:///x"]
    )
    assert RemoteKVConfig.from_namespace(ns).flush == "tier"
    with pytest.raises(ValueError, match="--remote-kv"):
        RemoteKVConfig.from_json(json.dumps({"mode": "nope"}))


def test_there_is_one_integration():
    """The linker is the only integration: ``--remote-kv-integration`` (seam|linker) is gone."""
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        _parser().parse_args(["--remote-kv", "dpu", "--remote-kv-integration", "linker"])
    ns = _parser().parse_args(["--remote-kv", "dpu", "--remote-kv-layerwise"])
    assert RemoteKVConfig.from_namespace(ns).layerwise


@pytest.mark.parametrize(
    ("preset", "extra", "want_linker"),
    [
        (None, {}, "sgl_remote_kv.sglang_glue.linker"),
        ("sgl_remote_kv.sglang_glue.linker", {}, "sgl_remote_kv.sglang_glue.linker"),  # theirs = ours
        ("some.other.linker", {}, "some.other.linker"),  # theirs kept (the tier off, warned)
        (None, {"radix_cache_backend": "lmcache"}, None),  # SGLang refuses the linker next to these:
        (None, {"disable_radix_cache": True}, None),  # the tier off, warned, the server runs
        (None, {"enable_hierarchical_cache": True}, None),
    ],
)
def test_resolve_hook_sets_the_linker_flags(monkeypatch, caplog, preset, extra, want_linker):
    """The plugin's BEFORE hook on ``ServerArgs.resolve_once``: SGLang's linker flags naming
    ``RemoteKVLinker``; linker flags the user set are left alone; an option SGLang refuses next to its
    linker keeps the tier off with one warning instead of a server that does not start."""
    import logging
    import types

    from sgl_remote_kv.sglang_glue import plugin

    monkeypatch.setattr(RemoteKVConfig, "current", classmethod(lambda cls: RemoteKVConfig(mode="inproc")))
    sa = types.SimpleNamespace(
        radix_cache_backend=None,
        disable_radix_cache=False,
        enable_hierarchical_cache=False,
        enable_unified_cache_external_linker=preset is not None,
        unified_cache_external_linker_backend="dynamic" if preset else None,
        unified_cache_external_linker_config={"linker": "X", "linker_module_path": preset}
        if preset
        else None,
    )
    vars(sa).update(extra)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin._before_resolve(sa)
    got = (sa.unified_cache_external_linker_config or {}).get("linker_module_path")
    assert got == want_linker
    assert sa.enable_unified_cache_external_linker == (want_linker is not None)
    warned = [r.getMessage() for r in caplog.records if r.name == plugin.__name__]
    assert len(warned) == (0 if want_linker == "sgl_remote_kv.sglang_glue.linker" else 1), warned
    if extra:
        assert "--remote-kv is off" in warned[0] and next(iter(extra)).replace("_", "-") in warned[0]
