"""sgl-remote-kv: a remote, compressed KV tier for SGLang's radix prefix cache.

Servers: ``python -m sglang.launch_server ... --remote-kv dpu`` (the plugin adds the flags). Offline
engines: ``sgl_remote_kv.configure(remote_kv="dpu", ...)`` before ``sglang.Engine(...)``.
"""

__version__ = "0.1.0"


def configure(**options):
    """See ``sgl_remote_kv.config.configure``."""
    from sgl_remote_kv.config import configure as _configure

    return _configure(**options)
