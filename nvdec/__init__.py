"""NVDEC path: KVFetcher's video layout, lossless HEVC codec, decoder pool, and adaptive resolution on the
serving path (``adapter.py``: Alg. 1; ``profile.py``: the measured decode table; ``versions.py``: the
write-back's extra resolutions).

The ``hevc`` codec (id 5) is listed in the codec registry (``sgl_remote_kv.codec.base``); its module is
imported lazily on first use. See docs/NVDEC.md.
"""
