"""Faults in the remote tier against one real CPU SGLang server (real SmolLM2 float32, lossless codec,
DPU data plane, a real redis-server behind a user-space TCP proxy that injects the network faults).

For every fault: the request completes with exactly the tokens a cold recompute gave, the server
stays healthy, the failure shows in ``sglang:remote_kv_*`` metrics, and once the fault clears the
tier serves full remote hits again. Tests run in file order and share the server (one start, ~2 min
on the shared 2-core box); the server starts while the store is unreachable (the first case).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from benchmarks import synthetic_kv as synthetic
from benchmarks.redis_server import RedisServer, free_port
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.model import model_identity
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.corruption import short_key
from sgl_remote_kv.store.framing import frame, unframe
from sgl_remote_kv.store.redis_store import redis_key
from sgl_remote_kv.types import KVLayout, ModelFingerprint
from tests.fixtures.faults import (
    CHUNK,
    TcpProxy,
    ask,
    data_plane_procs,
    failures,
    gen,
    healthy,
    log_matches,
    make_case,
    metric,
    prime,
    wait_for,
    wait_full_hit,
)
from tests.fixtures.remote_kv_server import flush_cache, metrics, remote_kv_server, storage_tokens

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis-faults"), free_port()).start()
    yield srv
    srv.stop(kill=True)


@pytest.fixture(scope="module")
def rdb(redis_srv):
    """Direct connection to Redis (bypassing the proxy): the test's own view and the attacker's."""
    import redis

    c = redis.Redis(port=redis_srv.port)
    yield c
    c.close()


@pytest.fixture(scope="module")
def proxy(redis_srv):
    p = TcpProxy("127.0.0.1", redis_srv.port)
    p.set_down(True)  # the server starts while its store is unreachable
    yield p
    p.close()


@pytest.fixture(scope="module")
def srv(model_dir, proxy):
    # Policy pinned to "always fetch": these tests are about faults, and the slow-store tests would
    # otherwise teach the policy to recompute for the tests after them (policy: tests/test_policy*).
    url = f"redis://{proxy.address}/0?timeout=5"
    with remote_kv_server(model_dir, url, "--remote-kv-policy-margin", "1e9") as s:
        yield s


@pytest.fixture(scope="module")
def chunk_keys(model_dir):
    """The keys the server derives for a prompt (same fingerprint, codec and namespace as the glue)."""
    fp = ModelFingerprint("LlamaForCausalLM", KVLayout(30, 3, 64, "float32"), model_identity(model_dir), 0, 1)
    codec = get_codec("lossless")

    def keys(ids: list[int], n: int, salt: str | None = None) -> list[bytes]:
        ns = keys_mod.namespace(fp, codec.name, codec.params_bytes(), salt)
        return keys_mod.chunk_keys(ns, ids[: n * CHUNK], CHUNK)

    keys.fingerprint, keys.codec = fp, codec
    return keys


@pytest.fixture(autouse=True)
def _heal_and_check(request, proxy):
    proxy.clear()
    yield
    proxy.clear()
    if "srv" in request.fixturenames:
        srv = request.getfixturevalue("srv")
        assert healthy(srv), f"server died:\n{srv.log_tail(40)}"


def _failure_kinds(srv) -> dict:
    return {k: v for k, v in metrics(srv).items() if "failures" in k or "lookups" in k}


def _in_fetch_then(srv, case, action, wait_s: float = 120) -> dict:
    """Ask for ``case`` in a thread, run ``action()`` once its fetch was submitted (decision counter
    moved), return the response. ``proxy.delay_s`` must hold the fetch in flight meanwhile."""
    flush_cache(srv)
    before = metric(srv, "decisions", path="dpu")
    box: dict = {}

    def run():
        box["out"] = gen(srv, case.ids)

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: metric(srv, "decisions", path="dpu") > before, 60, interval=0.05, what="fetch submitted")
    action()
    t.join(wait_s)
    assert "out" in box, "request did not complete"
    assert box["out"]["output_ids"] == case.ref, f"{case.name}: tokens differ from recompute"
    return box["out"]


# ---- store reachability -------------------------------------------------------------------------


def test_store_unreachable_at_start_then_recovers(srv, proxy, tok):
    lines = wait_for(lambda: log_matches(srv.log_text(), r"unreachable at start"), 30, what="start warning")
    assert len(lines) == 1 and proxy.address in lines[0], lines  # one clear line, naming the store
    case = make_case(tok, "unreachable-at-start")
    out = gen(srv, case.ids)  # the store is down: this answer is a pure recompute
    case.ref = out["output_ids"]
    assert storage_tokens(out) == 0 and out["meta_info"]["completion_tokens"] == 8
    # Counted (the autouse fixture heals the proxy before this body, so this lookup is a cold miss;
    # an outage's lookups are counted as errors: see test_store_errors_are_distinguishable_...).
    assert sum(metric(srv, "lookups", result=r) for r in ("miss", "error", "timeout")) >= 1
    assert healthy(srv)
    proxy.set_down(False)
    # Recovery: a later recompute writes the chunks back, then the prefix is a full remote hit.
    assert wait_full_hit(srv, case, timeout=180) == case.chunks * CHUNK


def test_store_outage_mid_run(srv, proxy, tok):
    case = prime(srv, make_case(tok, "outage"))
    failed = metric(srv, "lookups", result="error") + metric(srv, "lookups", result="timeout")
    proxy.set_down(True)
    for _ in range(3):
        _, hit = ask(srv, case)
        assert hit == 0
    assert metric(srv, "lookups", result="error") + metric(srv, "lookups", result="timeout") >= failed + 3
    proxy.set_down(False)
    assert wait_full_hit(srv, case) == case.chunks * CHUNK


def test_store_errors_are_distinguishable_from_misses_in_metrics(srv, proxy, tok):
    """An outage is ``lookups{result="error"}`` + ``store_errors_total{op="lookup",kind=...}``, never
    ``lookups{result="miss"}`` (a cold cache); a cold prompt still is a miss; each logged once."""
    case = prime(srv, make_case(tok, "outage-metrics"))
    misses, errors = metric(srv, "lookups", result="miss"), metric(srv, "lookups", result="error")
    store_errors = metric(srv, "store_errors", op="lookup", kind="unavailable")
    proxy.set_down(True)
    for _ in range(3):
        _, hit = ask(srv, case)
        assert hit == 0
    proxy.set_down(False)
    assert metric(srv, "lookups", result="error") >= errors + 3
    assert metric(srv, "lookups", result="miss") == misses  # the outage is not a cold cache
    assert metric(srv, "store_errors", op="lookup", kind="unavailable") > store_errors
    # logged once per process, not once per failed call
    assert len(log_matches(srv.log_text(), r"store count_prefix failed \(unavailable\)")) == 1
    assert wait_full_hit(srv, case) == case.chunks * CHUNK
    misses, errors = metric(srv, "lookups", result="miss"), metric(srv, "lookups", result="error")
    flush_cache(srv)
    gen(srv, make_case(tok, "outage-metrics-cold").ids)  # never written: the store answers "absent"
    assert metric(srv, "lookups", result="miss") == misses + 1
    assert metric(srv, "lookups", result="error") == errors


@pytest.mark.slow
def test_slow_store_costs_time_not_tokens(srv, proxy, tok):
    case = prime(srv, make_case(tok, "slow"))
    proxy.delay_s = 0.2  # every reply held back: slower hit, same answer
    _, hit = ask(srv, case)
    assert hit in (0, case.chunks * CHUNK)
    timeouts = metric(srv, "lookups", result="timeout")
    proxy.delay_s = 3.0  # beyond the lookup timeout (2 s): released as a miss, recomputed
    t0 = time.monotonic()
    _, hit = ask(srv, case)
    assert hit == 0 and time.monotonic() - t0 < 60
    assert metric(srv, "lookups", result="timeout") > timeouts
    proxy.clear()
    assert wait_full_hit(srv, case) == case.chunks * CHUNK


def test_flaky_connections(srv, proxy, tok):
    cases = [prime(srv, make_case(tok, f"flaky-{i}")) for i in range(2)]
    proxy.reset_rate = 0.3
    for _ in range(2):
        for case in cases:
            ask(srv, case)
    assert proxy.counts["resets"] > 0
    proxy.clear()
    for case in cases:
        assert wait_full_hit(srv, case) == case.chunks * CHUNK


def test_hung_store_is_a_miss_within_bounded_time(srv, proxy, tok):
    case = prime(srv, make_case(tok, "hung"))
    proxy.stall = True
    t0 = time.monotonic()
    _, hit = ask(srv, case)
    assert hit == 0 and time.monotonic() - t0 < 60
    proxy.clear()
    proxy.drop_connections()  # the stalled connections carry half-read replies
    assert wait_full_hit(srv, case) == case.chunks * CHUNK


# ---- bad values in the store ---------------------------------------------------------------------


def _variants(chunk_keys, key: bytes, raw: bytes) -> dict[str, bytes]:
    payload = unframe(key, raw)
    assert payload is not None
    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 0x10
    other = synthetic.fingerprint(num_layers=30, heads=3, dim=64, dtype="float32")
    k, v = synthetic.kv(other.layout, CHUNK, seed=1)
    return {
        "raw_bitflip": raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:],
        "setrange": raw[:200] + b"XXXX" + raw[204:],  # a user's ``SETRANGE key 200 XXXX``
        "truncated": raw[: len(raw) // 2],
        "codec_corrupt": frame(key, bytes(flipped)),
        "foreign_model": frame(key, chunk_keys.codec.encode(k, v, other)),
        "foreign_codec": frame(key, get_codec("quant_deflate").encode(k, v, chunk_keys.fingerprint)),
    }


CAUGHT_BY_FRAMING = ("raw_bitflip", "truncated")  # the client deletes these; the recompute rewrites
CORRUPT = ("raw_bitflip", "setrange", "truncated", "codec_corrupt")  # store_errors{kind="corrupt"}, once each


def test_corrupt_truncated_and_foreign_blobs_are_partial_misses(srv, tok, rdb, chunk_keys):
    case = prime(srv, make_case(tok, "bad-blobs"))
    keys = chunk_keys(case.ids, case.chunks)
    raws = rdb.mget([redis_key(k) for k in keys])
    assert all(raws), "the test derives the server's keys: every chunk must be in the store"
    for name, bad in _variants(chunk_keys, keys[1], raws[1]).items():
        flush_cache(srv)  # drains the write-back: the last recompute's chunks land now, not over ``bad``
        before = failures(srv)
        corrupt = metric(srv, "store_errors", op="get", kind="corrupt")
        rdb.set(redis_key(keys[1]), bad)
        _, hit = ask(srv, case)
        assert hit == CHUNK, (name, hit)  # chunk 0 is served, chunk 1 and after are recomputed
        assert failures(srv) > before, name
        counted = metric(srv, "store_errors", op="get", kind="corrupt") - corrupt
        assert counted == (1 if name in CORRUPT else 0), (name, counted)  # once per corrupt value
        if name in CAUGHT_BY_FRAMING:
            assert wait_full_hit(srv, case) == case.chunks * CHUNK, name  # deleted, then rewritten
        else:
            rdb.set(redis_key(keys[1]), raws[1])
    # logged (rate-limited, naming the key) in the server's log: the first of them at least
    assert f"corrupt value for chunk key {short_key(keys[1])}" in srv.log_text()


@pytest.mark.slow  # a server round trip + the repair write-back
def test_undecodable_chunk_is_repaired_by_the_recompute(srv, tok, rdb, chunk_keys):
    case = prime(srv, make_case(tok, "bad-blob-repair"))
    keys = chunk_keys(case.ids, case.chunks)
    raw = rdb.get(redis_key(keys[1]))
    rdb.set(redis_key(keys[1]), _variants(chunk_keys, keys[1], raw)["foreign_model"])
    _, hit = ask(srv, case)
    assert hit == CHUNK
    assert wait_full_hit(srv, case, timeout=45) == case.chunks * CHUNK


def test_writeback_failing_halfway_publishes_only_whole_chunks(srv, proxy, tok, rdb, chunk_keys):
    case = make_case(tok, "writeback-halfway", n_chunks=4)
    keys = chunk_keys(case.ids, case.chunks)
    flush_cache(srv)
    before = failures(srv)
    proxy.arm_cut(4 << 20)  # ~1.4 chunks into a put, the connection dies
    out = gen(srv, case.ids)
    case.ref = out["output_ids"]
    wait_for(lambda: proxy.counts["cuts"] > 0, 60, what="a write cut halfway")
    wait_for(lambda: failures(srv) > before, 60, what="the failed write-back counted")
    proxy.clear()
    stored = rdb.mget([redis_key(k) for k in keys])
    for k, raw in zip(keys, stored, strict=True):
        assert raw is None or unframe(k, raw) is not None, "a partial value became visible"
    assert any(v is None for v in stored), "the cut should have lost at least one chunk"
    leading = next((i for i, v in enumerate(stored) if v is None), len(stored))
    _, hit = ask(srv, case)
    assert hit == leading * CHUNK, (hit, leading)
    assert wait_full_hit(srv, case) == case.chunks * CHUNK


# ---- the data plane ------------------------------------------------------------------------------


def _dpu_pid(srv) -> int:
    procs = wait_for(lambda: data_plane_procs(srv.proc.pid), 60, what="a data plane process")
    return procs[0].pid


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGKILL, id="sigkill"),
        pytest.param(signal.SIGSTOP, id="sigstop-hang"),
        pytest.param(signal.SIGTERM, id="channel-closed"),
    ],
)
def test_data_plane_lost_mid_fetch(srv, proxy, tok, sig):
    case = prime(srv, make_case(tok, f"dpu-{sig.name}"))
    old = _dpu_pid(srv)
    restarts = len(log_matches(srv.log_text(), r"restarting data plane"))
    lost = metric(srv, "failures", kind="dataplane_lost")
    proxy.delay_s = 0.6  # hold the fetch in flight (lookups still answer within their 2 s timeout)
    try:
        _in_fetch_then(srv, case, lambda: os.kill(old, sig))
    finally:
        proxy.clear()
        if sig == signal.SIGSTOP and any(p.pid == old for p in data_plane_procs(srv.proc.pid)):
            os.kill(old, signal.SIGCONT)  # let a never-reaped plane run (and exit) after the test
    new = wait_for(lambda: [p.pid for p in data_plane_procs(srv.proc.pid) if p.pid != old], 90)
    assert new, "the data plane was not restarted"
    wait_for(
        lambda: not any(p.pid == old for p in data_plane_procs(srv.proc.pid)), 30, what="old plane reaped"
    )
    assert len(log_matches(srv.log_text(), r"restarting data plane")) == restarts + 1
    assert metric(srv, "failures", kind="dataplane_lost") > lost  # the lost in-flight chunks, counted
    assert wait_full_hit(srv, case) == case.chunks * CHUNK


# ---- tenants -------------------------------------------------------------------------------------


def test_tenants_never_share_remote_kv_nor_observe_each_others_prefix(srv, tok, rdb, chunk_keys):
    from sgl_remote_kv.store.keys import tenant_salt

    case = make_case(tok, "tenants")
    alice, bob = {"cache_salt": "alice"}, {"cache_salt": "bob"}
    prime(srv, case, **alice)
    a_keys = chunk_keys(case.ids, case.chunks, tenant_salt("alice", None))
    b_keys = chunk_keys(case.ids, case.chunks, tenant_salt("bob", None))
    assert all(rdb.mget([redis_key(k) for k in a_keys])) and not any(rdb.mget([redis_key(k) for k in b_keys]))
    gen(srv, case.ids, **alice)  # alice's prefix is now also in the local tree
    out = gen(srv, case.ids, **bob)
    assert out["meta_info"]["cached_tokens"] == 0 and storage_tokens(out) == 0, out["meta_info"]
    assert out["output_ids"] == case.ref
    flush_cache(srv)
    out = gen(srv, case.ids)  # no salt: the shared namespace is another tenant too
    assert out["meta_info"]["cached_tokens"] == 0 and storage_tokens(out) == 0
    _, hit = ask(srv, case, **alice)
    assert hit == case.chunks * CHUNK


# ---- logging -------------------------------------------------------------------------------------


def test_failures_are_logged_once_not_per_token(srv):
    """Across every fault above (hundreds of failed store calls and chunks), each warning message
    appears a bounded number of times: once per process and fault episode, never per chunk/token."""
    ours = r"(?i)store|remote[- ]kv|data plane|write-back|breaker|fetch"
    warnings = [ln for ln in log_matches(srv.log_text(), ours) if "server_args=" not in ln]
    templates: dict[str, int] = {}
    for line in warnings:
        key = " ".join(w for w in line.split()[2:12] if not any(c.isdigit() for c in w))
        templates[key] = templates.get(key, 0) + 1
    assert templates, "the faults above must have logged something"
    worst = max(templates.items(), key=lambda kv: kv[1])
    assert worst[1] <= 12, worst
