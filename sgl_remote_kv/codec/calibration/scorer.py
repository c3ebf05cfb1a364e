"""The model side of a calibration (``cli.py``): the model's KV of a text, and what coding it costs.

``Scorer`` runs the model (transformers, float32, on the CPU). ``Scorer.text`` reads one calibration text
into a ``Text``: the KV of its first ``PREFIX`` tokens (fewer on a short text: a multiple of 256, leaving
``CONT`` tokens) as the model caches it (RoPE applied on keys), the mean squared pre-RoPE query of every
query head over those tokens but the first ``FIT_SKIP``, and the next-token log-probabilities of the
``CONT`` tokens after them from that exact KV. ``Scorer.kl`` scores the same continuation given another
prefix KV (the coded one): its mean KL in nats against the exact KV's, and the top-1 agreement.

Contract: deterministic (no random step; the calibration's reproducibility rests on it); torch and
transformers are imported only when a ``Scorer`` is made.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PREFIX, CONT, FIT_SKIP = 1792, 64, 4


@dataclass
class Text:
    name: str
    digest: str  # SHA-256 of the text as the model read it
    prefix: np.ndarray  # [P] int64
    cont: np.ndarray  # [C] int64
    k: np.ndarray  # [L, P, H, D] float32 (RoPE applied, as cached)
    v: np.ndarray
    base_logp: object  # torch [C, vocab] from the exact KV
    q_energy: np.ndarray | None  # [L, query heads, D] mean squared pre-RoPE query (None: not found)


class Scorer:
    """The model, and the KL of continuations under a prefix KV against the exact one."""

    def __init__(self, model_path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()

    def text(self, name: str, content: str) -> Text:
        ids = np.asarray(self.tok(content)["input_ids"], np.int64)
        if len(ids) < 512 + CONT:
            raise ValueError(f"{name}: {len(ids)} tokens, need >= {512 + CONT}")
        p = min(PREFIX, (len(ids) - CONT) // 256 * 256)
        layers_mod = getattr(getattr(self.model, "model", None), "layers", None) or []
        qs: dict[int, np.ndarray] = {}
        hooks = [
            lay.self_attn.q_proj.register_forward_hook(
                lambda _m, _i, o, i=i: qs.__setitem__(i, o[0, FIT_SKIP:p].detach().numpy())
            )
            for i, lay in enumerate(layers_mod)
            if hasattr(getattr(lay, "self_attn", None), "q_proj")
        ]
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.from_numpy(ids[None, : p + CONT]), use_cache=True)
        for h in hooks:
            h.remove()
        logp = self.torch.log_softmax(out.logits[0, p:].float(), -1)
        layers = out.past_key_values.layers
        k = np.stack([lay.keys[0, :, :p].permute(1, 0, 2).numpy() for lay in layers])
        v = np.stack([lay.values[0, :, :p].permute(1, 0, 2).numpy() for lay in layers])
        q = None
        if len(qs) == k.shape[0]:
            d = k.shape[3]
            q = np.stack(
                [np.mean(np.square(qs[i].reshape(qs[i].shape[0], -1, d)), axis=0) for i in range(len(qs))]
            )
        digest = hashlib.sha256(content.encode()).hexdigest()
        return Text(name, digest, ids[:p], ids[p : p + CONT], k, v, logp, q)

    def out_proj(self, layer: int) -> np.ndarray | None:
        """The output projection [hidden, query heads * D] of ``layer`` (None if not Llama-like)."""
        try:
            return self.model.model.layers[layer].self_attn.o_proj.weight.detach().numpy()
        except AttributeError:
            return None

    def kl(self, t: Text, k: np.ndarray, v: np.ndarray) -> tuple[float, float]:
        """(mean KL in nats, top-1 agreement) of the continuation given prefix KV ``k, v`` (float32)."""
        from transformers import DynamicCache

        torch = self.torch
        pairs = [
            (
                torch.from_numpy(np.ascontiguousarray(k[i].transpose(1, 0, 2)))[None],
                torch.from_numpy(np.ascontiguousarray(v[i].transpose(1, 0, 2)))[None],
            )
            for i in range(k.shape[0])
        ]
        cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
        n = k.shape[1]
        with torch.no_grad():
            out = self.model(
                input_ids=torch.from_numpy(t.cont[None]),
                past_key_values=cache,
                position_ids=torch.arange(n, n + len(t.cont))[None],
                use_cache=True,
            )
        logp = torch.log_softmax(out.logits[0].float(), -1)
        kl = (t.base_logp.exp() * (t.base_logp - logp)).sum(-1).clamp_min(0)
        top1 = (t.base_logp.argmax(-1) == logp.argmax(-1)).float().mean()
        return float(kl.mean()), float(top1)
