"""The DPU client: the host side of the DPU data plane, in the SGLang scheduler process (``client.py``:
``DpuClient``; docs/DPU.md). The wire contract it shares with the data plane is ``sgl_remote_kv.contract``."""
