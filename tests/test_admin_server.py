"""``sgl-remote-kv-admin warm`` through a real server: a document warmed on one server makes the first
chat (with that document as its system message) on a *restarted* server a remote hit."""

from __future__ import annotations

import json

import pytest

from benchmarks.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.admin import cli
from tests.fixtures.remote_kv_server import CHUNK, storage_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two servers, ~1.5 min; the command's logic: test_admin.py
DOC = "/usr/share/common-licenses/Apache-2.0"


def test_warm_then_the_first_chat_after_a_restart_hits(model_dir, tmp_path, capsys):
    extra = (
        "--remote-kv",
        "dpu",
        "--remote-kv-store",
        f"file://{tmp_path / 'store'}",
        "--enable-metrics",
        "--enable-cache-report",
        "--remote-kv-chunk-size",
        str(CHUNK),
    )
    doc = tmp_path / "doc.txt"
    doc.write_text(open(DOC).read()[:4000])
    with SGLangServer(ServerSpec(model_path=model_dir, extra_args=extra)) as a:
        assert cli.main(["warm", "--server", a.base_url, "--file", str(doc), "--chat", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert (
        result["prompt_tokens"] > 600 and result["chunks_written"] == (result["prompt_tokens"] - 1) // CHUNK
    )
    with SGLangServer(ServerSpec(model_path=model_dir, extra_args=extra)) as b:
        from openai import OpenAI

        client = OpenAI(base_url=b.base_url + "/v1", api_key="EMPTY")
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model,
            max_tokens=4,
            temperature=0,
            extra_body={"return_cached_tokens_details": True},
            messages=[
                {"role": "system", "content": doc.read_text()},
                {"role": "user", "content": "Summarise."},
            ],
        )
        # every full chunk of the system message (its chat template included) came from the tier
        assert storage_tokens(out.model_dump()) >= (result["prompt_tokens"] - CHUNK)
