"""Redis Cluster backend (redis-py ``RedisCluster`` + hiredis), pipelined per shard.

URL: ``redis+cluster://[[user]:password@]host:port[,host:port...]?timeout=2&prefix=srkv:&ttl=0&batch=32``
(``rediss+cluster://`` over TLS, with the options of ``redis_store``). Any reachable subset of nodes is
enough to discover the cluster.

Keys are ``prefix + hex digest`` (``redis_store.redis_key``) without hash tags, so chunks spread evenly
over all shards; a
cluster pipeline groups the batch's commands by owning node and sends one pipeline per node.
Publish-after-full-write holds per key exactly as for standalone Redis (one ``SET`` per key; see
``redis_store``). If a shard is down (no replica to fail over to), operations touching its slots
fail with ``StoreUnavailable``; ``client.StoreClient`` turns that into misses and opens its breaker.

Thread-safety: ``RedisCluster`` keeps a connection pool per node; share one store between threads.
"""

from __future__ import annotations

from redis.cluster import ClusterNode, RedisCluster

from .base import parse_host_ports
from .redis_store import (
    DEFAULT_PREFIX,
    RedisKV,
    common_kwargs,
    connection_kwargs,
    split_url,
    translate_errors,
)


class RedisClusterStore(RedisKV):
    """Redis Cluster ``KVStore``."""

    def __init__(
        self,
        nodes: list[tuple[str, int]],
        timeout_s: float = 2.0,
        prefix: bytes = DEFAULT_PREFIX,
        ttl_s: int = 0,
        batch: int = 32,
        auth: dict | None = None,
    ) -> None:
        with translate_errors():
            client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                **(auth or {}),
                **connection_kwargs(timeout_s),
                require_full_coverage=False,  # serve the live shards when one is down
            )
        super().__init__(client, "redis-cluster", prefix, ttl_s, batch)
        self.nodes = list(nodes)


def open_redis_cluster(url: str) -> RedisClusterStore:
    """Factory for ``redis+cluster://h1:p1,h2:p2``."""
    parts, opts = split_url(url, "redis+cluster://host:port[,host:port...]")
    return RedisClusterStore(parse_host_ports(parts.netloc, url), **common_kwargs(url, opts))
