"""The ``cpu_prefix`` attention backend.

Unit tests on random tensors against a float64 reference and SGLang's own ``torch_native`` (no
server), then ``e2e`` tests on one real CPU server with the float32 model: greedy tokens identical to
transformers (plain prompts and after a cached prefix) and the cached-prefix TTFT bound.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sgl_remote_kv.sglang_glue import cpu_attention  # noqa: E402
from sgl_remote_kv.sglang_glue.cpu_attention import (  # noqa: E402
    CpuPrefixAttnBackend,
    attend_new_tokens,
    lower_right_causal_mask,
)

pytest_plugins = ["fixtures.sglang_server"]

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention shape
POOL = 4096


def _runner():
    pool = SimpleNamespace()  # not an SWAKVPool: no sliding-window pool translation
    return SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(), token_to_kv_pool=pool)


def _reference(q, k, v, *, scale, window=None, causal=True):
    """float64 attention of the last len(q) positions over all keys; [n, Hq, Dv]."""
    n, s = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    if causal:
        q_pos = torch.arange(s - n, s)[:, None]
        k_pos = torch.arange(s)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos >= q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64)


class _Batch:
    """A batch of requests whose KV sits at scattered pool slots, like the real KV pool."""

    def __init__(self, prefix_lens, extend_lens, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.prefix, self.extend = list(prefix_lens), list(extend_lens)
        self.seq = [p + e for p, e in zip(self.prefix, self.extend, strict=True)]
        self.k_cache = torch.randn(POOL, HKV, D, generator=g).to(dtype)
        self.v_cache = torch.randn(POOL, HKV, D, generator=g).to(dtype)
        self.req_to_token = torch.zeros(8, 2048, dtype=torch.int32)
        slots = torch.randperm(POOL, generator=g)[: sum(self.seq)].to(torch.int32)
        self.req_pool_indices = torch.tensor([5, 1, 7, 2][: len(self.seq)], dtype=torch.int64)
        start = 0
        for r, s in zip(self.req_pool_indices.tolist(), self.seq, strict=True):
            self.req_to_token[r, :s] = slots[start : start + s]
            start += s
        self.q = torch.randn(sum(self.extend), HQ, D, generator=g).to(dtype)
        self.scale = 1 / math.sqrt(D)

    def kv_of(self, i):
        idx = self.req_to_token[self.req_pool_indices[i], : self.seq[i]].long()
        return self.k_cache[idx], self.v_cache[idx]

    def extend_args(self):
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return dict(
            query=self.q,
            output=torch.empty_like(self.q),
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            req_to_token=self.req_to_token,
            req_pool_indices=self.req_pool_indices,
            seq_lens=t(self.seq),
            extend_prefix_lens=t(self.prefix),
            extend_seq_lens=t(self.extend),
        )


def _run_extend(backend, batch, **kw):
    args = batch.extend_args()
    q, o = args.pop("query"), args.pop("output")
    return backend._run_sdpa_forward_extend(
        q, o, *args.values(), None, scaling=batch.scale, enable_gqa=True, **kw
    )


def _backends():
    return CpuPrefixAttnBackend(_runner()), TorchNativeAttnBackend(_runner())


def test_mask_is_lower_right_aligned():
    m = lower_right_causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    w = lower_right_causal_mask(2, 5, sliding_window=1)
    assert w.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("n,prefix", [(1, 0), (7, 0), (1, 300), (13, 300), (64, 64)])
def test_attend_new_tokens_matches_float64_reference(dtype, tol, n, prefix):
    g = torch.Generator().manual_seed(n * 1000 + prefix)
    q = torch.randn(n, HQ, D, generator=g).to(dtype)
    k = torch.randn(prefix + n, HKV, D, generator=g).to(dtype)
    v = torch.randn(prefix + n, HKV, D, generator=g).to(dtype)
    out = attend_new_tokens(q, k, v, scale=D**-0.5)
    assert out.dtype == dtype and out.shape == (n, HQ, D)
    ref = _reference(q, k, v, scale=D**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_batch_with_cached_prefixes_matches_reference_and_torch_native(dtype):
    batch = _Batch(prefix_lens=[0, 17, 400, 399], extend_lens=[5, 1, 30, 1], dtype=dtype)
    ours, native = _backends()
    out = _run_extend(ours, batch, causal=True).clone()
    theirs = _run_extend(native, batch, causal=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for i, n in enumerate(batch.extend):
        k, v = batch.kv_of(i)
        ref = _reference(batch.q[start : start + n], k, v, scale=batch.scale)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=tol, rtol=tol)
        start += n
    torch.testing.assert_close(out, theirs, atol=tol, rtol=tol)


def test_extend_with_sliding_window_and_non_causal_match_torch_native():
    batch = _Batch(prefix_lens=[0, 50], extend_lens=[40, 9])
    ours, native = _backends()
    for kw in (dict(causal=True, sliding_window_size=16), dict(causal=False)):
        torch.testing.assert_close(
            _run_extend(ours, batch, **kw).clone(), _run_extend(native, batch, **kw), atol=1e-5, rtol=1e-5
        )
    k, v = batch.kv_of(1)
    ref = _reference(batch.q[40:], k, v, scale=batch.scale, window=16)
    out = _run_extend(ours, batch, causal=True, sliding_window_size=16)
    torch.testing.assert_close(out[40:].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_decode_matches_reference_and_torch_native(window):
    batch = _Batch(prefix_lens=[10, 300, 0], extend_lens=[1, 1, 1])
    args = batch.extend_args()
    for drop in ("extend_prefix_lens", "extend_seq_lens"):
        args.pop(drop)
    outs = []
    for backend in _backends():
        a = dict(args, output=torch.empty_like(batch.q))
        q, o = a.pop("query"), a.pop("output")
        outs.append(
            backend._run_sdpa_forward_decode(
                q, o, *a.values(), None, scaling=batch.scale, enable_gqa=True, sliding_window_size=window
            ).clone()
        )
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for i in range(3):
        k, v = batch.kv_of(i)
        ref = _reference(batch.q[i : i + 1], k, v, scale=batch.scale, window=window)
        torch.testing.assert_close(outs[0][i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_plan_is_built_once_per_forward_and_rebuilt_when_the_batch_changes(monkeypatch):
    built = []
    real = cpu_attention._build_plan
    monkeypatch.setattr(cpu_attention, "_build_plan", lambda *a: built.append(1) or real(*a))
    backend = CpuPrefixAttnBackend(_runner())
    batch = _Batch(prefix_lens=[3, 20], extend_lens=[2, 4])
    first = _run_extend(backend, batch, causal=True).clone()
    for _ in range(5):  # later layers of the same forward reuse the plan
        torch.testing.assert_close(_run_extend(backend, batch, causal=True), first)
    assert len(built) == 1
    other = _Batch(prefix_lens=[3, 21], extend_lens=[2, 4], seed=1)  # stale plan must be detected
    _run_extend(backend, other, causal=True)
    assert len(built) == 2
    moved = _Batch(prefix_lens=[3, 21], extend_lens=[2, 4], seed=1)  # same lengths, other slots
    moved.req_pool_indices = moved.req_pool_indices.flip(0)
    _run_extend(backend, moved, causal=True)
    assert len(built) == 3
    backend.init_forward_metadata(SimpleNamespace(out_cache_loc=None))  # a new forward drops it
    assert backend._plan is None


def test_encoder_decoder_batches_are_delegated_to_torch_native():
    batch = _Batch(prefix_lens=[0], extend_lens=[6])
    ours, native = _backends()
    args = batch.extend_args()
    q, o = args.pop("query"), args.pop("output")
    enc = torch.tensor([4], dtype=torch.int64)
    kw = dict(scaling=batch.scale, enable_gqa=True, causal=False, is_cross_attn=True)
    a = ours._run_sdpa_forward_extend(q, o.clone(), *args.values(), enc, **kw)
    b = native._run_sdpa_forward_extend(q, o.clone(), *args.values(), enc, **kw)
    torch.testing.assert_close(a, b)


def _best_of_3(backend, batch):
    import time

    times = []
    for _ in range(3):
        backend.init_forward_metadata(SimpleNamespace(out_cache_loc=None))
        t = time.perf_counter()
        _run_extend(backend, batch, causal=True)
        times.append(time.perf_counter() - t)
    return min(times)


def test_new_token_attention_is_much_cheaper_than_torch_native_on_a_cached_prefix():
    """One new token on a 1,500-token cached prefix: torch_native computes all 1,500 query rows."""
    batch = _Batch(prefix_lens=[1499], extend_lens=[1])
    ours, native = _backends()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops under 2-thread OpenMP on a loaded 2-core box are all noise
    try:
        t_ours, t_native = _best_of_3(ours, batch), _best_of_3(native, batch)
    finally:
        torch.set_num_threads(threads)
    assert t_ours * 5 < t_native, (t_ours, t_native)


def test_register_adds_the_backend_choice_factory_and_cpu_default():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    cpu_attention.register()
    cpu_attention.register()  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count("cpu_prefix") == 1
    assert ATTENTION_BACKENDS["cpu_prefix"] is cpu_attention.create_cpu_prefix_backend
    assert _HOOKS["handle_cpu_backends"].count(cpu_attention._default_cpu_backend) == 1
    with pytest.raises(NotImplementedError, match="MLA"):
        cpu_attention.create_cpu_prefix_backend(SimpleNamespace(use_mla_backend=True))


def test_cpu_platform_defaults_to_cpu_prefix():
    from sgl_remote_kv.sglang_glue.cpu_platform_impl import CpuDevPlatform

    assert CpuDevPlatform().get_default_attention_backend() == "cpu_prefix"


# ---------------------------------------------------------------------------------------------
# e2e: a real CPU server (default backend = cpu_prefix) with the real float32 model.
# ---------------------------------------------------------------------------------------------

_TEXTS = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def hf(model_dir):
    """transformers model + tokenizer, float32, greedy reference (test main thread)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def text_ids(hf):
    from pathlib import Path

    path = next((Path(p) for p in _TEXTS if Path(p).exists()), None)
    if path is None:
        pytest.fail(f"none of {_TEXTS} exists (Debian base-files provides them)")
    return hf[1](path.read_text())["input_ids"]


@pytest.fixture(scope="module")
def server(model_dir, sglang_module_server_factory):
    # Small chunks: the cold long prompt itself runs extends on top of its own cached first chunk.
    return sglang_module_server_factory(
        model_dir, extra_args=("--enable-cache-report", "--chunked-prefill-size", "512")
    )


def _hf_greedy(hf, ids, n):
    model, tok = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id
        )
    return out[0, len(ids) :].tolist()


def _sglang_greedy(server, ids, n):
    from fixtures.sglang_server import generate_ids

    out = generate_ids(server.base_url, ids, n)
    return out["output_ids"], int(out["meta_info"].get("cached_tokens", 0))


@pytest.mark.e2e
def test_server_runs_cpu_prefix_by_default(server):
    assert "'attention_backend': 'cpu_prefix'" in server.log_text()


@pytest.mark.e2e
def test_greedy_matches_transformers_on_plain_prompts(server, hf, text_ids):
    chat = hf[1].apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    for ids in (list(chat), text_ids[2000:2300]):
        got, cached = _sglang_greedy(server, ids, 24)
        assert cached == 0
        assert got == _hf_greedy(hf, ids, 24)


@pytest.mark.e2e
def test_greedy_matches_transformers_after_a_cached_prefix(server, hf, text_ids):
    prefix = text_ids[:1400]
    _sglang_greedy(server, prefix, 1)  # caches the prefix (itself chunked: 512 + 512 + 376)
    for suffix in (text_ids[1400:1430], text_ids[1400:1401]):
        ids = prefix + suffix
        got, cached = _sglang_greedy(server, ids, 24)
        assert cached >= len(prefix) - 1, "the prefix was not served from the radix cache"
        assert got == _hf_greedy(hf, ids, 24)


@pytest.mark.e2e
def test_cached_prefix_ttft_is_close_to_the_cost_of_the_new_tokens_alone(server):
    from fixtures.sglang_server import ttft_s

    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(1000, 40000, (n,), generator=g).tolist()  # noqa: E731
    long_prompt = rand(1500)
    cold, _ = ttft_s(server.base_url, long_prompt)
    hits, news = [], []
    for _ in range(3):
        t, cached = ttft_s(server.base_url, long_prompt + rand(30))
        assert cached >= 1500
        hits.append(t)
        news.append(ttft_s(server.base_url, rand(30))[0])
    hit, new = min(hits), min(news)
    print(f"TTFT cold {cold:.3f}s, cached-prefix hit {hit:.3f}s, 30 new tokens alone {new:.3f}s")
    assert hit < 4 * new, (hit, new)
    assert hit < cold / 3, (hit, cold)
