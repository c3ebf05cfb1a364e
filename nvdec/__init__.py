"""NVDEC path (issue 6): KVFetcher's video layout, lossless HEVC codec, decoder pool, adaptive resolution.

Importing this package registers the ``hevc`` codec (id 5) with the codec registry; the codec module
itself is imported lazily on first use. See docs/NVDEC.md.
"""

from sgl_remote_kv.codec.base import register

register("hevc", 5, "sgl_remote_kv.nvdec.hevc_codec:HevcCodec")
