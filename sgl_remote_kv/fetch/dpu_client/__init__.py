"""The DPU client: the host side of the DPU data plane, in the SGLang scheduler process (``client.py``:
``DpuClient``, its interface and lifecycle; ``receiver.py``: its receiver thread; ``supervisor.py``:
restarts and reconnects; docs/DPU.md). The wire contract it shares with the data plane is
``sgl_remote_kv.contract``."""
