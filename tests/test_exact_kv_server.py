"""Exact KV on demand against a real server with the quantized default codec.

One ``--remote-kv dpu`` server (a redis-server with ``--requirepass``, its password in
``--remote-kv-store-password-file``, values sealed with ``--remote-kv-auth-key-file``; the default codec,
fetch always preferred): a prompt is computed cold, written back, the local cache flushed; then

- a default request is a remote hit (storage tokens, ``hit_tokens_total{codec=<the default>}``);
- an EXACT request (``custom_params: {"remote_kv": "exact"}``) of the same prompt neither fetches nor
  matches the lossy nodes that hit installed: no cached tokens at all, and the cold request's tokens;
- asked again it is a local hit on its own exact nodes, same tokens;
- the same flag through the OpenAI API (``extra_body``, completions and chat) is accepted, an unknown value is HTTP 400 with
  a message that names the parameter; ``exact_requests_total`` counts them: ``recompute`` (nothing local),
  ``local_hit`` (the repeat, served by the local radix cache), never ``exact_path`` (no exact codec);
- no process of the server (launcher, scheduler, detokenizer, data plane) has the store password or the auth
  key on its command line.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from benchmarks.redis_server import RedisServer, free_port
from sgl_remote_kv.codec.calibration.cli import fingerprint_for
from sgl_remote_kv.fetch.paths import resolve_codec
from sgl_remote_kv.types import RopeSpec
from tests.fixtures.faults import gen, make_case, metric, wait_written
from tests.fixtures.remote_kv_server import flush_cache, remote_kv_server, storage_tokens

pytestmark = [pytest.mark.e2e]
EXACT = {"custom_params": {"remote_kv": "exact"}}
PASSWORD, AUTH_KEY = "exact-kv-store-pw-91c2", "5e" * 24


def _no_secret_on_any_command_line(srv) -> None:
    root = psutil.Process(srv.proc.pid)
    procs = [root, *root.children(recursive=True)]
    cmdlines = {p.pid: b"\0".join(a.encode() for a in p.cmdline()) for p in procs}
    assert any(b"sgl_remote_kv.dpu" in c for c in cmdlines.values()), "no data plane in the server's tree"
    assert len(cmdlines) >= 4, cmdlines  # launcher, scheduler, detokenizer, data plane (at least)
    for pid, cmd in cmdlines.items():
        for secret in (PASSWORD.encode(), AUTH_KEY.encode(), bytes.fromhex(AUTH_KEY)):
            assert secret not in cmd, f"a secret on the command line of pid {pid}"


def _exact(srv, ids):
    payload = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, **EXACT}}
    req = urllib.request.Request(
        srv.base_url + "/generate",
        data=json.dumps(payload).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_exact_requests_never_get_quantized_kv(model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    case = make_case(tok, "exact-kv", n_chunks=4)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    codec = resolve_codec("default", fingerprint_for(Path(model_dir), cfg), RopeSpec.from_hf_config(cfg)).name
    secrets = {"pw": PASSWORD, "auth.key": AUTH_KEY}
    for name, text in secrets.items():
        (tmp_path / name).write_text(text + "\n")
        (tmp_path / name).chmod(0o600)
    rs = RedisServer(tmp_path / "redis", free_port(), extra_args=("--requirepass", PASSWORD)).start()
    with (
        _stopping(rs),
        remote_kv_server(
            model_dir,
            f"redis://127.0.0.1:{rs.port}/0",
            "--remote-kv-policy-margin",
            "1e9",
            "--remote-kv-store-password-file",
            str(tmp_path / "pw"),
            "--remote-kv-auth-key-file",
            str(tmp_path / "auth.key"),
            codec="default",
            env={"SRKV_STORE_PASSWORD": ""},
        ) as srv,
    ):
        _no_secret_on_any_command_line(srv)
        cold = gen(srv, case.ids)
        wait_written(srv, 0, case.chunks)
        flush_cache(srv)

        hit = gen(srv, case.ids)
        assert storage_tokens(hit) == case.chunks * 64
        assert metric(srv, "hit_tokens", codec=codec) == case.chunks * 64
        level = "0.0005" if codec == "transform" else "none"  # `make test` calibrates: transform
        assert metric(srv, "hit_tokens_by_quality", quality=level) == case.chunks * 64

        exact = _exact(srv, case.ids)  # the lossy nodes the hit installed are in the tree now
        assert exact["meta_info"]["cached_tokens"] == 0, exact["meta_info"]
        assert exact["output_ids"] == cold["output_ids"]
        again = _exact(srv, case.ids)
        assert again["meta_info"]["cached_tokens"] > 0 and storage_tokens(again) == 0
        assert again["output_ids"] == cold["output_ids"]

        from openai import BadRequestError, OpenAI

        client = OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY")
        model = client.models.list().data[0].id
        out = client.completions.create(
            model=model, prompt=tok.decode(case.ids), max_tokens=4, temperature=0, extra_body=EXACT
        )
        assert out.choices[0].text
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0,
            extra_body=EXACT,
        )
        assert chat.choices[0].message.content is not None
        with pytest.raises(BadRequestError, match="remote_kv"):
            client.completions.create(
                model=model, prompt="hi", max_tokens=2, extra_body={"custom_params": {"remote_kv": "mostly"}}
            )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(
                urllib.request.Request(
                    srv.base_url + "/generate",
                    headers={"content-type": "application/json"},
                    data=json.dumps(
                        {"text": "hi", "sampling_params": {"custom_params": {"remote_kv": 1}}}
                    ).encode(),
                )
            )
        assert e.value.code == 400 and b"remote_kv" in e.value.read()
        # generate x2, completion, chat: the repeat (and the completion of the same prompt) are local hits
        outcomes = {
            o: metric(srv, "exact_requests", outcome=o) for o in ("recompute", "local_hit", "exact_path")
        }
        assert outcomes["recompute"] + outcomes["local_hit"] == 4 and outcomes["exact_path"] == 0, outcomes
        assert outcomes["recompute"] >= 1 and outcomes["local_hit"] >= 1, outcomes  # the first, the repeat
        assert metric(srv, "hit_tokens") == case.chunks * 64  # the exact requests fetched nothing
        assert metric(srv, "store_errors", kind="auth") == 0  # the password was accepted
        assert PASSWORD not in srv.log_text()


@contextlib.contextmanager
def _stopping(rs: RedisServer):
    try:
        yield rs
    finally:
        rs.stop(kill=True)
