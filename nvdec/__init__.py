"""NVDEC path: KVFetcher's video layout, lossless HEVC codec, decoder pool (adaptive resolution is a
benchmark-side simulation, ``benchmarks/nvdec_adaptive.py``; serving encodes at one resolution).

The ``hevc`` codec (id 5) is listed in the codec registry (``sgl_remote_kv.codec.base``); its module is
imported lazily on first use. See docs/NVDEC.md.
"""
