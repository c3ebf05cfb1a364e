"""The data-plane contract: what a host (``fetch/dpu_client``, ``store/via_dpu.py``) and a data plane
(``dpu/``) agree on -- the wire messages (``messages.py``) and their framing (``protocol.py``), the CURVE
keys of an authenticated endpoint (``auth.py``), the endpoint rule (``endpoints.py``) and the names of
shared-memory regions and run directories (``shm_names.py``). A leaf: it imports nothing else of the
package."""
