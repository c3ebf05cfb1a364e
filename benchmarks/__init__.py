"""Benchmarks for sgl-remote-kv (codec table, rate-distortion sweep, store and network benches)."""
