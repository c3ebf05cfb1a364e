"""The docs a new user copies from say what the code accepts: README's CPU keywords for
``sglang.Engine`` (what the CPU server command passes as flags; without ``max_total_tokens`` SGLang sizes
the KV cache from free memory and is OOM-killed on a small box), and docs/USAGE.md's
``--remote-kv-store`` row (every scheme the flag accepts). Fast: nothing is started. README's examples run
for real in ``tests/test_engine_api.py::test_readme_engine_example`` (e2e)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from benchmarks.launcher import CPU_ARGS
from sgl_remote_kv.preflight import check_store_url
from sgl_remote_kv.store import base

ROOT = Path(__file__).resolve().parent.parent
CPU_MARKER = "<!-- engine-cpu-keywords -->"


def readme_cpu_keywords() -> dict[str, object]:
    """The ``sgl.Engine(...)`` keywords of the ```python block after README's CPU marker (literals)."""
    text = (ROOT / "README.md").read_text()
    at = text.find(CPU_MARKER)
    assert at >= 0, f"README.md has no {CPU_MARKER} line followed by the CPU Engine call"
    block = re.match(r"[ \t]*\n```python\n(.*?)\n```", text[at + len(CPU_MARKER) :], re.S)
    assert block, f"README.md: the line after {CPU_MARKER} must open a ```python block"
    calls = [n for n in ast.walk(ast.parse(block.group(1))) if isinstance(n, ast.Call)]
    (call,) = [c for c in calls if ast.unparse(c.func).endswith("Engine")]
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_readme_names_the_engine_keywords_a_cpu_user_needs():
    from sglang.srt.server_args import ServerArgs

    kw = readme_cpu_keywords()
    need = {"device", "dtype", "max_total_tokens", "cuda_graph_backend_decode", "cuda_graph_backend_prefill"}
    assert need <= set(kw), sorted(need - set(kw))
    engine_options = set(inspect.signature(ServerArgs).parameters)
    assert {k for k in kw if not k.startswith("remote_kv")} <= engine_options  # real Engine keywords
    # the same values as the launcher's CPU flags (what every CPU server of this project runs with)
    flags = dict(zip(CPU_ARGS, CPU_ARGS[1:], strict=False))
    for name in ("device", "cuda_graph_backend_decode", "cuda_graph_backend_prefill"):
        assert kw[name] == flags["--" + name.replace("_", "-")], name
    assert isinstance(kw["max_total_tokens"], int) and 0 < kw["max_total_tokens"] <= 65536
    assert kw["remote_kv"] == "dpu" and kw["model_path"] == "<model>"


def test_usage_store_row_lists_every_accepted_scheme():
    text = (ROOT / "docs" / "USAGE.md").read_text()
    (row,) = [ln for ln in text.splitlines() if ln.startswith("| `--remote-kv-store` |")]
    values = row.split(" | ")[1]
    wrappers = {"auth", "faulty"}  # prefixes of another URL (check_store_url unwraps them)
    for scheme in sorted(set(base._REGISTRY) - wrappers):
        assert f"`{scheme}://" in values, f"docs/USAGE.md's --remote-kv-store row omits {scheme}://"
    for prefix in wrappers:
        assert f"`{prefix}+`" in values, f"docs/USAGE.md's --remote-kv-store row omits the {prefix}+ prefix"
    for url in re.findall(r"`([a-z+]+://[^`]*)`", values):  # every example URL there is accepted
        concrete = re.sub(r"\[.*?\]", "", url).replace("host:port", "h:1").replace("h:p", "h:1")
        assert check_store_url(concrete.replace("/db", "/0")) == concrete.replace("/db", "/0"), url
