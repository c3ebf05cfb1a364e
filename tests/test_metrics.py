"""The tier's Prometheus metrics: closed label sets, pre-registered series."""

from __future__ import annotations


def test_metric_labels_are_closed_sets_and_preregistered():
    """failures/store_errors label values come from closed enums (raw kinds folded, never a new
    series), and every known series exists at 0 before its first event (alerts see 0, not no data)."""
    from prometheus_client import REGISTRY

    from sgl_remote_kv.metrics import get
    from sgl_remote_kv.types import FailureKind

    m = get()

    def value(name: str, **labels) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert value("sglang:remote_kv_failures_total", kind="write") is not None  # pre-registered
    assert value("sglang:remote_kv_store_errors_total", op="get", kind="io") is not None
    assert value("sglang:remote_kv_lookups_total", result="timeout") is not None
    before = value("sglang:remote_kv_failures_total", kind="internal")
    m.failure("install:SomeNewError")  # an open-ended value: folded into internal
    m.failure(FailureKind.WRITE)
    assert value("sglang:remote_kv_failures_total", kind="internal") == before + 1
    assert value("sglang:remote_kv_failures_total", kind="install:SomeNewError") is None
    io = value("sglang:remote_kv_store_errors_total", op="put", kind="io")
    m.store_error("put", "io:EROFS")
    assert value("sglang:remote_kv_store_errors_total", op="put", kind="io") == io + 1
    assert value("sglang:remote_kv_store_errors_total", op="put", kind="io:EROFS") is None
    assert FailureKind.of("store_io:ENOSPC") is FailureKind.STORE_OTHER
    # the store breaker gauge: both circuits exist at 0 (closed); a state sets its rank
    assert value("sglang:remote_kv_store_breaker_state", circuit="write") is not None
    m.store_breaker("write", "open")
    assert value("sglang:remote_kv_store_breaker_state", circuit="write") == 2
    m.store_breaker("write", "closed")
    assert value("sglang:remote_kv_store_breaker_state", circuit="write") == 0
