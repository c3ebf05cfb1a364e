"""The fault-tolerant client, driven through the fault-injecting wrapper (the only fakes are faults)."""

from __future__ import annotations

import os
import time

import pytest

from sgl_remote_kv.store.client import ClientConfig, PrefixLookup, StoreClient
from sgl_remote_kv.store.faulty import FaultConfig, FaultyStore
from sgl_remote_kv.store.framing import frame, unframe
from sgl_remote_kv.store.local import LocalStore

FAST = ClientConfig(timeout_s=0.5, retries=1, retry_backoff_s=0.001, breaker_failures=3, breaker_reset_s=0.3)


@pytest.fixture
def inner(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def make(inner: LocalStore, faults: FaultConfig | None = None, **cfg) -> tuple[StoreClient, FaultyStore]:
    faulty = FaultyStore(inner, faults)
    config = ClientConfig(**{**FAST.__dict__, **cfg})
    return StoreClient(faulty, config), faulty


def keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def test_outage_is_a_miss_then_breaker_opens_then_recovers(inner) -> None:
    client, faulty = make(inner)
    ks = keys(3)
    assert client.put_many([(k, b"v") for k in ks]) == 3
    faulty.set_faults(FaultConfig(down=True))
    for _ in range(3):  # every failure is a miss, nothing raises
        assert client.get_many(ks) == [None] * 3
        assert client.count_prefix(ks) == 0
    st = client.stats()
    assert st.circuit == "open"
    assert st.errors["unavailable"] >= 3 and st.errors["circuit_open"] >= 1
    t0 = time.perf_counter()
    assert client.get_many(ks) == [None] * 3  # open: fails fast without touching the store
    assert time.perf_counter() - t0 < 0.05
    assert client.put_many([(ks[0], b"w")]) == 0
    faulty.set_faults(FaultConfig())  # store is back
    time.sleep(0.35)  # breaker_reset_s: the next call is the half-open probe
    assert client.count_prefix(ks) == 3
    assert client.stats().circuit == "closed"
    assert client.get_many(ks) == [b"v"] * 3


def test_failed_probe_reopens_the_breaker(inner) -> None:
    client, faulty = make(inner, FaultConfig(down=True))
    for _ in range(3):
        client.get_many(keys(1))
    assert client.stats().circuit == "open"
    time.sleep(0.35)
    client.get_many(keys(1))  # probe fails
    assert client.stats().circuit == "open"
    faulty.set_faults(FaultConfig())
    time.sleep(0.35)
    client.get_many(keys(1))
    assert client.stats().circuit == "closed"


def test_slow_store_times_out_into_a_miss(inner) -> None:
    client, _ = make(inner, FaultConfig(latency_s=1.0), timeout_s=0.1, retries=0)
    t0 = time.perf_counter()
    assert client.get_many(keys(2)) == [None, None]
    assert time.perf_counter() - t0 < 0.5
    assert client.stats().errors == {"timeout": 1}


def test_transient_errors_are_retried(inner) -> None:
    ks = keys(1)
    inner.put_many([(ks[0], frame(ks[0], b"payload"))])
    # seed 1: the first draw fails, the retry succeeds (deterministic)
    client, _ = make(inner, FaultConfig(error_rate=0.5, seed=1), retries=3, breaker_failures=100)
    results = [client.get_many(ks)[0] for _ in range(40)]
    st = client.stats()
    assert st.extra["retries"] >= 1 and st.errors["unavailable"] == st.extra["retries"] + results.count(None)
    assert results.count(b"payload") >= 35  # 4 attempts at p=0.5: almost always a hit
    again, _ = make(inner, FaultConfig(error_rate=0.5, seed=1), retries=3, breaker_failures=100)
    assert [again.get_many(ks)[0] for _ in range(40)] == results  # same seed, same outcome


def test_corrupt_blob_is_a_miss_and_is_deleted(inner) -> None:
    client, faulty = make(inner)
    ks = keys(2)
    client.put_many([(k, os.urandom(1000)) for k in ks])
    faulty.set_faults(FaultConfig(corrupt_rate=1.0))
    assert client.get_many(ks) == [None, None]
    assert client.stats().errors["corrupt"] == 2
    assert faulty.stats().extra["injected_corrupt"] == 2
    assert inner.count_prefix(ks[:1]) == 0 and inner.get_many(ks) == [None, None]  # never served again


def test_truncated_or_misplaced_blobs_are_misses(inner) -> None:
    client, _ = make(inner)
    k1, k2, k3 = keys(3)
    blob = frame(k1, b"0123456789")
    inner.put_many([(k1, blob[:-3]), (k2, blob), (k3, b"raw, unframed")])  # k2 holds k1's value
    assert client.get_many([k1, k2, k3]) == [None, None, None]
    assert client.stats().errors["corrupt"] == 3
    assert unframe(k1, blob) == b"0123456789"


def test_dropped_puts_are_misses_and_negative_cache_hides_them_briefly(inner) -> None:
    client, faulty = make(inner, FaultConfig(drop_rate=1.0), negative_ttl_s=0.3)
    k = keys(1)
    assert client.put_many([(k[0], b"v")]) == 1  # the store acknowledged, then lost it
    assert client.get_many(k) == [None]
    faulty.set_faults(FaultConfig())
    inner.put_many([(k[0], frame(k[0], b"v"))])  # another process publishes it
    assert client.get_many(k) == [None]  # recent miss: answered from the negative cache
    assert client.count_prefix(k) == 0
    assert client.stats().extra["negative_cache_hits"] == 2
    time.sleep(0.35)
    assert client.get_many(k) == [b"v"]


def test_own_put_clears_negative_cache(inner) -> None:
    client, _ = make(inner, negative_ttl_s=60)
    k = keys(1)
    assert client.count_prefix(k) == 0
    client.put_many([(k[0], b"v")])
    assert client.count_prefix(k) == 1


def test_partial_availability_serves_the_available_batches(inner) -> None:
    client, faulty = make(inner, batch=1, breaker_failures=1000)
    ks = keys(40)
    client.put_many([(k, b"v") for k in ks])
    faulty.set_faults(FaultConfig(unavailable_fraction=0.5))
    got = client.get_many(ks)
    down = [faulty.key_unavailable(k) for k in ks]
    assert 5 < sum(down) < 35
    assert [v is None for v in got] == down
    first_down = down.index(True)
    assert client.count_prefix(ks[:first_down]) == first_down
    assert client.count_prefix(ks) == 0  # the batch touches an unavailable key: a miss


def test_counters_and_latency(inner) -> None:
    client, _ = make(inner)
    ks = keys(3)
    client.put_many([(ks[0], b"a" * 100), (ks[1], b"b" * 50)])
    assert client.get_many(ks) == [b"a" * 100, b"b" * 50, None]
    assert client.count_prefix(ks) == 2
    st = client.stats()
    assert (st.hits, st.misses, st.bytes_read, st.bytes_written, st.keys_written) == (4, 2, 150, 150, 2)
    assert st.latency["get_many"].count == 1 and st.latency["get_many"].max_s > 0
    assert st.backend.startswith("client:") and st.circuit == "closed" and st.errors == {}


def test_closed_client_and_unreachable_store_never_raise(tmp_path) -> None:
    from sgl_remote_kv.store.client import open_client

    for url in ("redis://127.0.0.1:1/0?timeout=0.2", "redis+cluster://127.0.0.1:1?timeout=0.2"):
        client = open_client(url, FAST)  # nothing listens on port 1
        assert client.get_many(keys(1)) == [None]
        assert client.put_many([(keys(1)[0], b"v")]) == 0
        assert client.stats().errors["unavailable"] >= 1
        client.close()
        assert client.get_many(keys(1)) == [None]


def test_deadline_grows_with_the_bytes_of_the_call(inner) -> None:
    # 0.2 s of injected latency: a 2 MB call at >= 1 MB/s may take 0.05 + 2 s, a tiny one only 0.05 s
    client, _ = make(inner, FaultConfig(latency_s=0.2), timeout_s=0.05, min_mb_s=1.0, retries=0)
    k_big, k_small = keys(2)
    assert client.put_many([(k_big, b"x" * 2_000_000)]) == 1
    assert client.put_many([(k_small, b"x")]) == 0
    assert client.stats().errors == {"timeout": 1}
    assert client.get_many([k_big]) == [
        b"x" * 2_000_000
    ]  # the running average blob size (~300 KB) extends the deadline


def test_soak_random_faults_from_threads_never_raise_nor_serve_wrong_bytes(inner) -> None:
    import threading

    faults = FaultConfig(
        latency_s=0.0005, jitter_s=0.002, error_rate=0.2, corrupt_rate=0.2, drop_rate=0.1, seed=5
    )
    client, _ = make(inner, faults, breaker_failures=5, breaker_reset_s=0.05, negative_ttl_s=0.01)
    ks = keys(16)
    want = {k: os.urandom(2000) for k in ks}
    wrong: list[bytes] = []
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(60):
                sub = ks[(seed + i) % 8 : (seed + i) % 8 + 8]
                client.put_many([(k, want[k]) for k in sub[:3]])
                client.count_prefix(sub)
                for k, v in zip(sub, client.get_many(sub), strict=True):
                    if v is not None and v != want[k]:
                        wrong.append(k)
        except BaseException as e:  # thread boundary: the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = client.stats()
    assert errors == [] and wrong == []
    assert st.hits > 0 and st.errors.get("corrupt", 0) > 0 and st.errors.get("unavailable", 0) > 0


# ---- separate breakers for reads and writes; errors told apart from misses ---------------------------


def _break_writes(store: LocalStore) -> None:
    """Make the real embedded store refuse every write with an OS error, as a read-only or full disk
    does: its temp directory (where each value is written before being renamed in) becomes a file."""
    import shutil

    shutil.rmtree(store.root / "tmp")
    (store.root / "tmp").write_bytes(b"")


class _ReadsDown:
    """Reads go through the fault wrapper with a full outage, writes reach the real store."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.faulty = inner, FaultyStore(inner, FaultConfig(down=True))
        self.count_prefix, self.get_many = self.faulty.count_prefix, self.faulty.get_many
        self.put_many, self.delete_many = inner.put_many, inner.delete_many
        self.stats, self.close = inner.stats, inner.close


def test_failing_write_backs_do_not_make_lookups_fail_fast(inner) -> None:
    events: list[tuple[str, str, int]] = []
    client = StoreClient(inner, FAST, on_error=lambda *e: events.append(e))
    ks = keys(4)
    assert client.put_many([(k, b"v") for k in ks[:2]]) == 2
    _break_writes(inner)
    for k in ks[2:] * 3:  # a burst of failed write-backs: the write breaker opens
        assert client.put_many([(k, b"w")]) == 0
    assert client.circuits() == {"read": "closed", "write": "open"}
    t0 = time.perf_counter()
    assert client.put_many([(ks[3], b"w")]) == 0  # fails fast now
    assert time.perf_counter() - t0 < 0.05
    for _ in range(5):  # reads are untouched: real answers, no error
        assert client.lookup_prefix(ks).found == 2 and client.lookup_prefix(ks).error is None
        assert client.get_many(ks) == [b"v", b"v", None, None]
    assert client.circuits()["read"] == "closed"
    put_kinds = {kind for op, kind, _ in events if op == "put"}
    assert put_kinds == {"io:ENOTDIR", "breaker_open"}, events
    assert all(op == "put" for op, _, _ in events), events


def test_failing_reads_do_not_drop_write_backs(inner) -> None:
    events: list[tuple[str, str, int]] = []
    client = StoreClient(_ReadsDown(inner), FAST, on_error=lambda *e: events.append(e))
    ks = keys(3)
    for _ in range(3):
        assert client.lookup_prefix(ks).error == "unavailable"
    assert client.circuits() == {"read": "open", "write": "closed"}
    assert client.lookup_prefix(ks) == client.lookup_prefix(ks[:1])  # fails fast, still an error
    assert client.lookup_prefix(ks).error == "breaker_open"
    assert client.get_many(ks) == [None] * 3
    assert client.put_many([(k, b"v") for k in ks]) == 3  # writes still land
    assert inner.count_prefix(ks) == 3 and unframe(ks[0], inner.get_many(ks[:1])[0]) == b"v"
    assert client.circuits()["write"] == "closed"
    assert {(op, kind) for op, kind, _ in events} == {
        ("lookup", "unavailable"),
        ("lookup", "breaker_open"),
        ("get", "breaker_open"),
    }


def test_lookup_errors_are_not_misses_and_reach_the_listener(inner) -> None:
    events: list[tuple[str, str, int]] = []
    faulty = FaultyStore(inner)
    client = StoreClient(faulty, FAST, on_error=lambda *e: events.append(e))
    ks = keys(3)
    want = [os.urandom(1000) for _ in ks[:2]]
    client.put_many(list(zip(ks[:2], want, strict=True)))
    assert client.lookup_prefix(ks).found == 2 and client.lookup_prefix(ks).error is None
    assert client.lookup_prefix(keys(2)).error is None  # a cold key is a miss, not an error
    assert events == []
    faulty.set_faults(FaultConfig(error_rate=1.0, error_kind="timeout"))
    assert client.lookup_prefix(ks).error == "timeout" and client.count_prefix(ks) == 0
    assert events[-1] == ("lookup", "timeout", 1)
    faulty.set_faults(FaultConfig(corrupt_rate=1.0))
    time.sleep(0.35)  # let the read breaker's probe through
    got = client.get_many(ks[:2])  # a flip in the header's pad bytes leaves the payload intact
    assert all(v is None or v == w for v, w in zip(got, want, strict=True))
    assert ("get", "corrupt", got.count(None)) == events[-1] and got.count(None) >= 1, events
    client.on_error = lambda *e: 1 / 0  # a broken listener never breaks a store call
    faulty.set_faults(FaultConfig(down=True))
    assert client.lookup_prefix(ks) == PrefixLookup(0, "unavailable")
    assert client.stats().errors["ZeroDivisionError"] == 1


def test_breaker_state_changes_reach_the_metrics_gauge(inner) -> None:
    """Every read-breaker transition is reported once (open, then the half-open probe, then closed) and
    lands in the metrics' ``store_breaker_state{circuit}`` gauge (0 closed, 1 half-open, 2 open)."""
    from sgl_remote_kv.metrics import RemoteKVMetrics

    client, faulty = make(inner)
    metrics, seen = RemoteKVMetrics(), []

    def listener(circuit: str, state: str) -> None:
        seen.append((circuit, state))
        metrics.store_breaker(circuit, state)

    client.on_breaker = listener
    ks = keys(2)
    faulty.set_faults(FaultConfig(down=True))
    for _ in range(4):
        client.get_many(ks)
    assert seen == [("read", "open")] and metrics.snapshot()["store_breaker|circuit=read"] == 2
    faulty.set_faults(FaultConfig())
    time.sleep(0.35)  # breaker_reset_s: the next call is the half-open probe
    assert client.count_prefix(ks) == 0
    assert seen == [("read", "open"), ("read", "half_open"), ("read", "closed")]
    assert metrics.snapshot()["store_breaker|circuit=read"] == 0
    client.on_breaker = lambda *a: 1 / 0  # a broken listener never fails a store call
    faulty.set_faults(FaultConfig(down=True))
    for _ in range(4):
        assert client.get_many(ks) == [None, None]
