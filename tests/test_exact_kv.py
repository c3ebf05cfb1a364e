"""Per-request exactness (``KVFidelity``) in the admission queue, without SGLang.

A request whose ``custom_params`` say ``{"remote_kv": "exact"}`` must never get KV decoded from a lossy
codec: it fetches from exact paths only, recomputes when there is none, and — while some path installs
lossy KV into the local tree — gets a radix namespace of its own, so it cannot match those nodes either.
The seam's part (the extra-key suffix, the tenant salt without it, the API check) is tested at the end.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from sgl_remote_kv.admission import Phase, WaitingForKV
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.fetch.base import FetchPath
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.sglang_glue import seam
from sgl_remote_kv.store.keys import tenant_salt
from sgl_remote_kv.types import KVFidelity, PathName
from tests.admission_fakes import C, make_queue, req


def _exact(r):
    r.fidelity = KVFidelity.EXACT
    return r


def _world(paths: str):
    """``lossy``: one DPU path with a quantizing codec; ``mixed``: that plus an exact (lossless) INPROC
    path."""
    w = make_queue()
    quant = get_codec("quant_deflate")
    dpu = FetchPath(PathName.DPU, w.be, quant)
    chosen = {PathName.DPU: dpu}
    if paths == "mixed":
        chosen[PathName.INPROC] = FetchPath(PathName.INPROC, type(w.be)(), get_codec("lossless"))
    c = dataclasses.replace(
        w.c,
        paths=chosen,
        policy=Policy(PolicyConfig(mode="auto", margin=1e9), available=tuple(p.value for p in chosen)),
    )
    w.q = WaitingForKV(c, w.q.s)
    w.c, w.quant = c, quant
    return w


def _count(w, key: str) -> float:
    return w.c.metrics.snapshot().get(key, 0)


def test_an_exact_request_on_a_lossy_tier_is_isolated_and_not_parked():
    w = _world("lossy")
    r = _exact(req("x", 5 * C + 1))
    w.stored(r, 5, w.quant)
    assert not w.q.park(r)  # nothing exact to fetch: SGLang computes it
    assert getattr(r, "isolated", False)  # and its local match cannot see lossy nodes
    assert _count(w, "exact_requests|outcome=recompute") == 1
    plain = req("y", 5 * C + 1)
    w.stored(plain, 5, w.quant)
    assert w.q.park(plain) and not getattr(plain, "isolated", False)  # the default is untouched


def test_an_exact_request_fetches_from_the_exact_path_only():
    w = _world("mixed")
    r = _exact(req("x", 6 * C + 1))
    w.stored(r, 6, w.quant)  # the lossy namespace has the whole prefix ...
    w.stored(r, 2, get_codec("lossless"))  # ... the exact one two chunks
    assert w.q.park(r)
    assert set(w.q.parked["x"].chain) == {PathName.INPROC}
    w.q.parked["x"].lookup.result(timeout=10)
    w.q.poll()
    p = w.q.parked["x"]
    assert (p.path, len(p.fetch_keys), p.phase) == (PathName.INPROC, 2, Phase.FETCH)
    assert getattr(r, "isolated", False)  # a lossy path exists: isolated all the same
    assert _count(w, "exact_requests|outcome=exact_path") == 1


def test_exact_requests_on_an_exact_tier_share_the_local_tree():
    w = make_queue()  # one path, lossless codec
    r = _exact(req("x", 4 * C + 1))
    w.stored(r, 4)
    assert w.q.park(r) and not getattr(r, "isolated", False)
    assert _count(w, "exact_requests|outcome=exact_path") == 1


@pytest.mark.parametrize("paths", ["lossy", "exact"])
def test_an_exact_request_served_from_the_local_cache_is_a_local_hit_not_a_recompute(paths):
    """``recompute`` means recompute: an exact request whose prompt the local radix cache holds (its own
    exact nodes; with or without an exact path to fetch from) is ``local_hit``, once."""
    w = _world("lossy") if paths == "lossy" else make_queue()
    r = _exact(req("x", 4 * C + 1))
    w.stored(r, 4, w.quant if paths == "lossy" else None)
    w.c.tree.local["x"] = 4 * C  # asked again: the first answer's exact nodes are in the tree
    assert not w.q.park(r)
    cold = _exact(req("y", 4 * C + 1))  # nothing local: on a lossy tier it is computed
    parked = w.q.park(cold)
    assert parked == (paths == "exact")
    assert _count(w, "exact_requests|outcome=local_hit") == 1
    assert _count(w, "exact_requests|outcome=recompute") == (0 if parked else 1)
    assert _count(w, "exact_requests|outcome=exact_path") == (1 if parked else 0)


@pytest.mark.parametrize("paths", ["lossy", "exact"])
def test_a_few_locally_matched_template_tokens_are_a_recompute_not_a_local_hit(paths):
    """Only a chat template's leading tokens (3 of ~5 chunks) in the local cache: the bulk of the prompt
    is computed, so ``recompute`` -- not ``local_hit``. On the exact tier the request is parked as
    before (``exact_path``); a local match up to the last full chunk is the ``local_hit``."""
    w = _world("lossy") if paths == "lossy" else make_queue()
    template = _exact(req("t", 5 * C + 1))
    w.c.tree.local["t"] = 3  # "<|im_start|>user\n" and nothing more
    parked = w.q.park(template)
    assert parked == (paths == "exact")
    assert _count(w, "exact_requests|outcome=local_hit") == 0
    assert _count(w, "exact_requests|outcome=recompute") == (0 if parked else 1)
    whole = _exact(req("w", 5 * C + 1))
    w.c.tree.local["w"] = 5 * C  # all a remote hit could have served
    assert not w.q.park(whole)
    assert _count(w, "exact_requests|outcome=local_hit") == 1


def test_exact_outcome_rule():
    from sgl_remote_kv.admission.queue import exact_outcome

    assert exact_outcome(0, 4 * C, 4 * C + 1) == "recompute"
    assert exact_outcome(12, 10 * C, 700) == "recompute"  # 12 template tokens of 700
    assert exact_outcome(10 * C - 1, 10 * C, 10 * C + 5) == "recompute"  # one token short of the reach
    assert exact_outcome(10 * C, 10 * C, 10 * C + 5) == "local_hit"
    assert exact_outcome(10 * C + 4, 10 * C, 10 * C + 5) == "local_hit"
    # a prompt shorter than anything the tier stores: the bulk (half) decides
    assert exact_outcome(2, 0, 10) == "recompute"
    assert exact_outcome(5, 0, 10) == "local_hit"


# -- the seam: what the request objects carry -----------------------------------------------------------
def _sglang_req(extra_key=None, cache_salt=None, custom_params=None):
    return types.SimpleNamespace(
        extra_key=extra_key,
        cache_salt=cache_salt,
        sampling_params=types.SimpleNamespace(custom_params=custom_params),
    )


@pytest.mark.parametrize("extra_key", [None, "lora-7"])
def test_isolation_changes_the_radix_namespace_not_the_store_namespace(extra_key):
    r = _sglang_req(extra_key=extra_key, cache_salt="t1", custom_params={"remote_kv": "exact"})
    salt = seam.req_salt(r)
    assert seam.req_fidelity(r) is KVFidelity.EXACT
    seam.isolate_exact(r)
    seam.isolate_exact(r)  # idempotent (retracted requests come back)
    assert r.extra_key == (extra_key or "") + seam.EXACT_SUFFIX
    assert seam.req_salt(r) == salt == tenant_salt("t1", extra_key)


def test_request_fidelity_is_validated():
    assert seam.req_fidelity(_sglang_req()) is KVFidelity.ANY
    assert seam.req_fidelity(_sglang_req(custom_params={"remote_kv": "any", "other": 1})) is KVFidelity.ANY
    with pytest.raises(ValueError, match="remote_kv.*'exact'.*'exacct'"):
        seam.check_sampling_params(types.SimpleNamespace(custom_params={"remote_kv": "exacct"}))
    seam.check_sampling_params(types.SimpleNamespace(custom_params=None))
    # a value that slipped past the API check is read the safe way
    assert seam.req_fidelity(_sglang_req(custom_params={"remote_kv": 3})) is KVFidelity.EXACT


def test_the_codec_registry_says_which_codecs_are_exact():
    assert get_codec("lossless").exact
    assert not any(get_codec(n).exact for n in ("quant_deflate", "quant_rans", "cachegen", "hevc"))
