"""Quality of decoded KV against recomputation, with the real model (float32).

For a text with prefix P (KV from a codec) and continuation C (64 real tokens):
- ``kl``: mean over the 64 positions of KL(p_recompute || p_decoded) in nats, where p_recompute comes from
  the model run on P + C from scratch and p_decoded from the model run on C with the decoded KV of P;
- ``top1``: fraction of those positions whose argmax agrees;
- ``greedy_match``: after feeding C[0], 32 greedy tokens generated from each cache; fraction identical
  position by position (noisy: one flip diverges the rest).

Decoded K goes into the cache as is: cached keys already carry RoPE. Baselines are cached on disk per text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.kvdata import CACHE, TextKV, to_f32

GREEDY = 32


@dataclass
class Baseline:
    logp: torch.Tensor  # [CONT, vocab] float32 log-probs from recomputation
    greedy: np.ndarray  # [GREEDY] int64


def build_cache(model, k: np.ndarray, v: np.ndarray):
    """DynamicCache from KV ``[layers, tokens, heads, dim]`` (any storage dtype; bf16 as uint16 bits)."""
    from transformers import DynamicCache

    pairs = []
    for layer in range(k.shape[0]):
        kl = torch.from_numpy(np.ascontiguousarray(to_f32(k[layer]).transpose(1, 0, 2)))[None]
        vl = torch.from_numpy(np.ascontiguousarray(to_f32(v[layer]).transpose(1, 0, 2)))[None]
        pairs.append((kl, vl))
    return DynamicCache(ddp_cache_data=pairs, config=model.config)


@torch.no_grad()
def continuation_logp(model, cache, cont_ids: np.ndarray) -> torch.Tensor:
    n = cache.get_seq_length()
    ids = torch.from_numpy(cont_ids[None])
    pos = torch.arange(n, n + len(cont_ids))[None]
    out = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


@torch.no_grad()
def greedy_tokens(model, cache, first: int, n: int = GREEDY) -> np.ndarray:
    toks, cur = [], first
    pos = cache.get_seq_length()
    for _ in range(n):
        out = model(
            input_ids=torch.tensor([[cur]]),
            past_key_values=cache,
            position_ids=torch.tensor([[pos]]),
            use_cache=True,
        )
        cur = int(out.logits[0, -1].argmax())
        toks.append(cur)
        pos += 1
    return np.asarray(toks, dtype=np.int64)


@torch.no_grad()
def recompute_baseline(model, text: TextKV) -> Baseline:
    """Run the model on P + C from scratch (full float32, no cache reuse); cached on disk per text."""
    f = CACHE / f"{text.name}.baseline.pt"
    if f.exists():
        d = torch.load(f)
        return Baseline(d["logp"], d["greedy"].numpy())
    base = compute_baseline(model, text.prefix_ids, text.cont_ids)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    torch.save({"logp": base.logp, "greedy": torch.from_numpy(base.greedy)}, tmp)
    os.replace(tmp, f)
    return base


@torch.no_grad()
def compute_baseline(model, prefix_ids: np.ndarray, cont_ids: np.ndarray) -> Baseline:
    """Log-probs over the continuation and greedy tokens, the model run on P + C from scratch."""
    ids = np.concatenate([prefix_ids, cont_ids])
    out = model(input_ids=torch.from_numpy(ids[None]), use_cache=True)
    n = len(prefix_ids)
    logp = torch.log_softmax(out.logits[0, n:].float(), dim=-1)
    cache = out.past_key_values
    if len(cont_ids) > 1:
        cache.crop(-(len(cont_ids) - 1))  # keep P + C[0]: greedy continues from there
    return Baseline(logp, _greedy_after_crop(model, cache, out.logits[0, n], n + 1))


def _greedy_after_crop(model, cache, logits0: torch.Tensor, pos: int) -> np.ndarray:
    cur = int(logits0.argmax())
    toks = [cur]
    for i in range(GREEDY - 1):
        out = model(
            input_ids=torch.tensor([[cur]]),
            past_key_values=cache,
            position_ids=torch.tensor([[pos + i]]),
            use_cache=True,
        )
        cur = int(out.logits[0, -1].argmax())
        toks.append(cur)
    return np.asarray(toks, dtype=np.int64)


def compare(base: Baseline, logp: torch.Tensor, greedy: np.ndarray) -> dict:
    kl = (base.logp.exp() * (base.logp - logp)).sum(-1).clamp_min(0)
    top1 = (base.logp.argmax(-1) == logp.argmax(-1)).float().mean()
    match = float(np.mean(base.greedy == greedy))
    return {"kl": float(kl.mean()), "top1": float(top1), "greedy_match": match}


def evaluate(model, text: TextKV, base: Baseline, k: np.ndarray, v: np.ndarray, greedy: bool = True) -> dict:
    """Quality of decoded prefix KV ``k, v`` for ``text`` against its recompute baseline."""
    logp = continuation_logp(model, build_cache(model, k, v), text.cont_ids)
    toks = base.greedy
    if greedy:
        toks = greedy_tokens(model, build_cache(model, k, v), int(text.cont_ids[0]))
    res = compare(base, logp, toks)
    if not greedy:
        res["greedy_match"] = None
    return res
