"""``sgl-remote-kv-admin``: look after a remote KV store (stats, verify, evict, warm-up); see ``cli``."""
