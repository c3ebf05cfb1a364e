"""A tiny random-weight Llama built from a config (no download), for checking fetched KV end to end.

``build(dtype, device)`` makes a transformers ``LlamaForCausalLM`` of ``CONFIG`` with weights drawn from
a fixed seed on the CPU (the same weights on every machine), moved to ``device``. ``prefix_kv`` runs a
prefill and returns its KV in the tier's layout (``[layers, tokens, kv_heads, head_dim]``, storage dtype:
bf16 as uint16 bits); ``continue_from`` runs a suffix and a continuation over a given prefix KV and
returns each step's next-token log-probs (greedy, or teacher-forced on given tokens).

The weights' init scale (``INIT_STD``) is larger than a trained model's default 0.02: with 0.02 a random
Llama's next-token distribution is nearly uniform and no KV error shows in it; at 0.08 the top token
carries a clear share and the prefix decides it (a KV error moves the log-probs).

Only the documented forward API is used (``model(input_ids, past_key_values, use_cache)``,
``DynamicCache().update(k, v, layer)``); reading a prefill's cache goes through ``_layer_kv``, which
knows both transformers cache layouts (``cache.layers[i].keys``, 4.5x+, and ``cache[i]``, older).
"""

from __future__ import annotations

import numpy as np
import torch

from sgl_remote_kv.types import KVLayout, ModelFingerprint, numpy_storage_dtype

SEED = 1234
INIT_STD = 0.08
CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=INIT_STD,
)
ROPE_THETA = 10000.0  # LlamaConfig's default (neox-style rotate_half): the transform codec's RopeSpec

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def layout(dtype: str) -> KVLayout:
    return KVLayout(CONFIG["num_hidden_layers"], CONFIG["num_key_value_heads"], CONFIG["head_dim"], dtype)


def fingerprint(dtype: str) -> ModelFingerprint:
    return ModelFingerprint("LlamaForCausalLM", layout(dtype), f"tiny-llama-seed{SEED}".ljust(16, "0"))


def build(dtype: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIG)
    cfg._attn_implementation = "eager"  # the same math on every device and version
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)  # random init from the seed, on the CPU
    return model.to(device=device, dtype=TORCH[dtype]).eval()


def prompt(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab_size"], (tokens,), generator=g)


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    k, v = cache[layer][:2]
    return k, v


def _to_storage(t: torch.Tensor, dtype: str) -> np.ndarray:
    """``[1, H, T, D]`` -> numpy ``[T, H, D]`` in the layout's storage dtype (bf16: raw bits)."""
    t = t[0].transpose(0, 1).contiguous().cpu()
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy().astype(numpy_storage_dtype(dtype), copy=False)


def from_storage(a: np.ndarray, dtype: str, device) -> torch.Tensor:
    """numpy ``[T, H, D]`` (storage dtype) -> ``[1, H, T, D]`` torch tensor of ``dtype`` on ``device``."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype == "bfloat16":
        t = t.view(torch.int16).view(torch.bfloat16)
    return t.transpose(0, 1)[None].contiguous().to(device)


@torch.no_grad()
def prefix_kv(model, ids: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The prefill KV of ``ids``: ``(k, v)`` numpy ``[layers, T, kv_heads, head_dim]`` (storage dtype)."""
    dev = next(model.parameters()).device
    out = model(input_ids=ids[None].to(dev), use_cache=True)
    ks, vs = zip(
        *(_layer_kv(out.past_key_values, i) for i in range(CONFIG["num_hidden_layers"])), strict=True
    )
    return np.stack([_to_storage(k, dtype) for k in ks]), np.stack([_to_storage(v, dtype) for v in vs])


def cache_of(k: np.ndarray, v: np.ndarray, dtype: str, device):
    """A transformers ``DynamicCache`` holding ``k``/``v`` (``[layers, T, H, D]`` storage dtype)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(k.shape[0]):
        cache.update(from_storage(k[layer], dtype, device), from_storage(v[layer], dtype, device), layer)
    return cache


@torch.no_grad()
def continue_from(
    model, cache, suffix: torch.Tensor, steps: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Run ``suffix`` after the prefix held by ``cache`` (``None``: no prefix), then ``steps - 1`` more
    tokens: the greedy pick, or ``forced[i]`` (teacher forcing). Returns the greedy tokens of every step
    and the float32 next-token log-probs ``[steps, vocab]``."""
    dev = next(model.parameters()).device
    ids = suffix[None].to(dev)
    tokens, logps = [], []
    for i in range(steps):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        logps.append(lp.cpu())
        tokens.append(int(lp.argmax()))
        nxt = forced[i] if forced is not None else tokens[-1]
        ids = torch.tensor([[nxt]], device=dev)
    return tokens, torch.stack(logps)


def kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """Per-step KL(p || q) of log-prob rows (float64)."""
    p, q = p_logp.double(), q_logp.double()
    return (p.exp() * (p - q)).sum(-1)


def margins(logp: torch.Tensor) -> torch.Tensor:
    """Per step: top-1 minus top-2 log-prob (how close a greedy pick was to a tie)."""
    top = logp.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]
