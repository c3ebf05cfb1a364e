"""The fetch paths: how a stored prefix gets from the store into the KV pool, in one place.

- ``base.py``: the path interface (``FetchBackend``, ``FetchHandle``, ``FetchPath``) the waiting_for_KV
  queue drives;
- ``paths.py``: which paths a deployment runs and which codec it writes (``--remote-kv
  dpu|nvdec|inproc|auto``, ``resolve_codec``);
- ``inproc.py``: fetch + decode on worker threads of the serving process;
- ``dpu.py``: the path over the DPU data plane, through the DPU client (``dpu_client/``: the host side of
  the data plane: its process or service link, destination region, host rounds, pool writes);
- ``nvdec.py``: the path over the video decoder pool (the decoder library is ``sgl_remote_kv.nvdec``).
- ``layerwise.py``: layer-wise installs (``--remote-kv-layerwise``): a request released once its chunks are
  verified, each layer awaited (or decoded from the verified blobs) before the linker's load copies it.

Nothing here imports SGLang; the glue (``sglang_glue/``) builds the paths (``assemble.build_runtime``).
"""
