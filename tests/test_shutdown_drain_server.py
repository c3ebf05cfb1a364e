"""SIGTERM of a server right after a request: the request's write-back is in the store once it stopped.

A real CPU SGLang server (SmolLM2 float32, lossless codec, DPU path, chunks of 64 tokens with tail
sub-chunks of 16) writes to a real redis-server behind the fault proxy (``tests/fixtures/faults.py``).
The request generates one token, so its 3 chunks and its 2 tail sub-chunks are queued for the write-back
together when it finishes. Right after the response every store reply is held back ``DELAY_S`` (the
fault; one per value written) and the server gets SIGTERM: the chunks' put is answered ~3 x ``DELAY_S``
later, the tail's existence check ``DELAY_S`` after that, so the tail's put leaves the scheduler ~8 s
after the response.

SGLang's tokenizer notices SIGTERM within its 5 s poll and sends ``ShutdownReq``; the scheduler's graceful
exit calls our cache's ``release_host_resources``, which waits for the write-back (at most 10 s: enough
for the tail's put to leave). Every chunk and tail sub-chunk key must be in Redis afterwards, and the
server's log must show the drain (SGLang's SIGTERM path reached it). Without the drain the scheduler
begins to exit within ~2 s of ``ShutdownReq``, before the tail's put leaves: the tail is lost. The
drain itself, deterministically: ``tests/test_shutdown_drain.py``.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from benchmarks.redis_server import RedisServer, free_port
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.model import model_identity
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.redis_store import redis_key
from sgl_remote_kv.types import KVLayout, ModelFingerprint
from tests.fixtures.faults import TcpProxy
from tests.fixtures.remote_kv_server import CHUNK, generate, remote_kv_server

pytestmark = pytest.mark.e2e

TAIL = 16
DELAY_S = 1.9  # per store reply once the response is back: the tail's put leaves ~4 x DELAY_S later


@pytest.fixture
def redis_and_proxy(tmp_path):
    srv = RedisServer(tmp_path / "redis", free_port()).start()
    proxy = TcpProxy("127.0.0.1", srv.port)
    try:
        yield srv, proxy
    finally:
        proxy.close()
        srv.stop(kill=True)


def _prompt_keys(model_dir: str, ids: list[int], chunks: int, subs: int) -> list[bytes]:
    """The keys the server derives for ``ids``: ``chunks`` chunk keys, then ``subs`` tail sub-chunk keys."""
    fp = ModelFingerprint("LlamaForCausalLM", KVLayout(30, 3, 64, "float32"), model_identity(model_dir), 0, 1)
    codec = get_codec("lossless")
    ns = keys_mod.namespace(fp, codec.name, codec.params_bytes(), None)
    full = keys_mod.chunk_keys(ns, ids[: chunks * CHUNK], CHUNK)
    tail = keys_mod.tail_keys(full[-1], ids[chunks * CHUNK : (chunks + 1) * CHUNK], TAIL)
    return full + tail[:subs]


def test_sigterm_right_after_a_request_drains_the_write_back(model_dir, redis_and_proxy):
    import redis

    rsrv, proxy = redis_and_proxy
    rng = random.Random(40)
    ids = [rng.randrange(1000, 30000) for _ in range(3 * CHUNK + 2 * TAIL + 9)]  # 3 chunks, 2 subs, 9 left
    want = _prompt_keys(model_dir, ids, 3, 2)
    url = f"redis://{proxy.address}/0?timeout=5"
    with remote_kv_server(model_dir, url, "--remote-kv-tail-tokens", str(TAIL)) as srv:
        generate(srv, ids, 1)  # finishes at its prefill: chunks and tail queued at once
        proxy.delay_s = DELAY_S
        t0 = time.monotonic()
        srv.stop(grace_s=60)  # SIGTERM to the server; the launcher escalates only after 30 s
        stop_s = time.monotonic() - t0
        log = srv.log_text()
    print(f"SIGTERM -> server gone: {stop_s:.1f} s; {re.findall(r'shutdown: .*', log)}")
    db = redis.Redis(port=rsrv.port)
    try:
        present = [bool(db.exists(redis_key(k))) for k in want]
    finally:
        db.close()
    assert present == [True] * len(want), (present, log[-3000:])
    drain = re.search(r"shutdown: (write-back drained in ([0-9.]+) s|the write-back did not drain)", log)
    assert drain, f"no drain on SGLang's SIGTERM path:\n{log[-3000:]}"
    assert drain.group(2) is None or float(drain.group(2)) > 0.5, "the scheduler's exit waited for it"
    assert stop_s < 30, "SIGTERM must stop the server within SGLang's grace (5 s poll + 10 s drain + exit)"
