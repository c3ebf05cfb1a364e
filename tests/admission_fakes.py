"""Doubles for the admission queue's ports (``sgl_remote_kv.admission.ports``): a radix tree +
allocator, the engine's queue, a direct fetch backend finished by the test, a store, a fake clock, and
``make_queue`` that wires them to a real ``WaitingForKV`` with the real policy and metrics."""

from __future__ import annotations

import threading
import types

import torch

from sgl_remote_kv.admission import AdmissionSettings, Agreement, Collaborators, WaitingForKV
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.fetch.base import FetchHandle, FetchPath
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.runtime import KeySpace
from sgl_remote_kv.types import KVFidelity, KVLayout, ModelFingerprint, PathName

C = 16  # chunk size
FP = ModelFingerprint("LlamaForCausalLM", KVLayout(2, 1, 8, "float32"), "w")
CODEC = get_codec("lossless")
MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


class Tree:
    """Radix tree + allocator double: ``local[rid]`` tokens of a prompt are cached on the device."""

    def __init__(self, capacity: int) -> None:
        self.cap = capacity
        self.free_slots = list(range(capacity))
        self.local: dict[str, int] = {}
        self.owned: list[int] = []  # slots the tree took at insert
        self.locks = 0
        self.writes = 0

    def match(self, req, end: int):
        return types.SimpleNamespace(prefix_len=min(self.local.get(req.rid, 0), end), node=req.rid)

    def lock(self, node):
        self.locks += 1
        return ("lock", node)

    def unlock(self, lock) -> None:
        if lock is not None:
            self.locks -= 1

    def capacity(self) -> int:
        return self.cap

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots) -> None:
        if slots is not None:
            self.free_slots += slots.tolist()

    def write(self, slots, handle) -> None:
        self.writes += 1

    def insert(self, req, prefix_node, start: int, slots):
        self.local[req.rid] = start + len(slots)
        self.owned += slots.tolist()
        return self.lock(req.rid)

    def give_back(self) -> None:
        """The engine evicts what the tree owns (the requests finished)."""
        self.free_slots += self.owned
        self.owned = []


class Host:
    def __init__(self) -> None:
        self.released: list = []
        self.waiting_reqs: list = []
        self.hits: dict[str, tuple[int, int]] = {}

    rid = staticmethod(lambda req: req.rid)
    prompt = staticmethod(lambda req: req.ids)
    salt = staticmethod(lambda req: None)
    eligible = staticmethod(lambda req: True)
    fidelity = staticmethod(lambda req: getattr(req, "fidelity", KVFidelity.ANY))

    @staticmethod
    def isolate_exact(req) -> None:
        req.isolated = True

    def mark_hit(self, req, start: int, tokens: int) -> None:
        self.hits[req.rid] = (start, tokens)

    def release(self, req) -> None:
        self.released.append(req.rid)
        self.waiting_reqs.append(req)

    def hand_to_abort(self, req) -> None:
        self.waiting_reqs.append(req)

    def waiting(self) -> set[int]:
        return {id(r) for r in self.waiting_reqs}


class Backend:
    """A direct backend whose fetches finish when the test calls ``finish``."""

    direct = True
    tails = True

    def __init__(self) -> None:
        self.handles: dict[str, FetchHandle] = {}

    def submit(self, rid, keys, start, slots, tokens=None):
        h = FetchHandle(rid, len(keys), start, C, tokens)
        h.direct, h.rows = True, slots
        self.handles[rid] = h
        return h

    def finish(self, rid: str, ok_chunks: int | None = None) -> None:
        h = self.handles[rid]
        if ok_chunks is not None:
            h._fail_from(ok_chunks, "store_miss")
        h._finish()

    def queue_depth(self) -> int:
        return 0

    def close(self) -> None:
        pass


class Store:
    """Chunk keys present in the 'store' (lookups answer how many leading keys exist)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def lookup(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return types.SimpleNamespace(found=n, error=None)


def req(rid: str, tokens: int, base: int = 0):
    return types.SimpleNamespace(rid=rid, ids=list(range(base, base + tokens)))


def make_queue(
    capacity: int = 4096,
    fraction: float = 0.5,
    slot_wait_s: float = 5.0,
    layerwise=None,
    agreement: Agreement | None = None,
    margin: float | None = None,
    fp: ModelFingerprint = FP,
    tail: int = 0,
    wrap_tree=None,
):
    """A queue over fresh doubles (``tail``: tail sub-chunk tokens, 0 = off; ``wrap_tree(tree)``: the
    ``TreeOps`` the queue gets over the tree double); returns a namespace
    (q, tree, host, be, stored(req, chunks[, codec][, subs]), c)."""
    tree, host, be, store = Tree(capacity), Host(), Backend(), Store()
    keys = KeySpace(fp, CODEC, C)
    pcfg = PolicyConfig(mode="dpu") if margin is None else PolicyConfig(mode="dpu", margin=margin)
    c = Collaborators(
        tree=tree if wrap_tree is None else wrap_tree(tree),
        host=host,
        paths={PathName.DPU: FetchPath(PathName.DPU, be, CODEC)},
        policy=Policy(pcfg, available=("dpu",)),
        metrics=RemoteKVMetrics(),
        lookup=store.lookup,
        delete=lambda ks: None,
        keys=keys.keys_for,
        tail_keys=keys.tail_keys,
        agreement=agreement or Agreement(),
        bytes_per_token=fp.layout.bytes_per_token(),
        wakeup=threading.Event(),
        layerwise=layerwise,
    )
    settings = AdmissionSettings(
        chunk_size=C, tail_granule=tail, slot_wait_s=slot_wait_s, max_pool_fraction=fraction
    )
    q = WaitingForKV(c, settings)

    def stored(r, chunks: int, codec=None, subs: int = 0) -> None:
        """The first ``chunks`` chunks of ``r``'s prompt are in the store (under ``codec``'s namespace), and
        the first ``subs`` tail sub-chunks of the next chunk's region."""
        full = keys.keys_for(r.ids, chunks, None, codec)
        store.keys.update(full)
        if subs:
            prev = full[-1] if full else None
            store.keys.update(keys.tail_keys(r.ids, chunks, prev, None, codec, tail)[:subs])

    return types.SimpleNamespace(q=q, tree=tree, host=host, be=be, stored=stored, c=c)
