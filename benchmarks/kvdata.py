"""Real SmolLM2 KV for the codec benchmarks: texts found on this machine, extracted once, cached on disk.

Each text is tokenized; its first ``PREFIX`` tokens are the cached prefix (KV extracted with the float32
model through transformers) and the next ``CONT`` tokens are the teacher-forced continuation used by
``benchmarks.quality``. KV is stored as bf16 bits (``np.uint16``) shaped ``[layers, tokens, kv_heads, dim]``
-- exactly what the codecs consume -- under ``<repo>/.cache/kvdata/``.

Texts are the product's catalogue (``sgl_remote_kv.codec.calibration.texts.SOURCES``: prose, code, JSON,
non-English prose, chat turns) and carry a role: ``tune`` texts (the calibration's fit set,
``CALIBRATION``) choose the default codec config, ``heldout`` texts (every other one) report it, per kind.

CLI: ``python -m benchmarks.kvdata`` extracts everything and lists the texts with their paths.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgl_remote_kv.codec.calibration import texts as ct

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "kvdata"
PREFIX = 1792  # 7 chunks of 256 tokens
CONT = 64
MIN_TOKENS = 2000
# (name, role, kind): every catalogue text; tune = the calibration's fit set.
TEXT_SOURCES: list[tuple[str, str, str]] = [
    (n, "tune" if n in ct.CALIBRATION else "heldout", s.kind.value) for n, s in ct.SOURCES.items()
]


@dataclass
class TextKV:
    name: str
    role: str
    kind: str
    path: str
    total_tokens: int
    prefix_ids: np.ndarray  # [PREFIX] int64
    cont_ids: np.ndarray  # [CONT] int64
    k: np.ndarray  # [L, PREFIX, H, D] uint16 (bf16 bits)
    v: np.ndarray


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even), returned as uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_f32(x: np.ndarray) -> np.ndarray:
    """Decoded KV of any storage dtype (bf16 bits, fp16, fp32) as float32."""
    return bf16_to_f32(x) if x.dtype == np.uint16 else x.astype(np.float32)


def load_model(threads: int | None = None):
    """The float32 SmolLM2 model and tokenizer (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_remote_kv.model import ensure_model

    if threads:
        torch.set_num_threads(threads)
    d = ensure_model("float32")
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return model, tok


def model_dir() -> Path:
    from sgl_remote_kv.model import ensure_model

    return ensure_model("float32")


def fingerprint(dtype: str = "bfloat16"):
    """ModelFingerprint of the benchmark model with KV stored as ``dtype``."""
    from sgl_remote_kv.model import model_identity
    from sgl_remote_kv.types import KVLayout, ModelFingerprint

    d = model_dir()
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype)
    return ModelFingerprint(architecture="LlamaForCausalLM", layout=layout, weights_id=model_identity(d))


def extract_kv(model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefill ``ids`` in float32; return K, V as float32 ``[layers, tokens, kv_heads, dim]``."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids[None]), use_cache=True)
    layers = out.past_key_values.layers
    k = np.stack([lay.keys[0].permute(1, 0, 2).numpy() for lay in layers])
    v = np.stack([lay.values[0].permute(1, 0, 2).numpy() for lay in layers])
    return k, v


def _extract_one(name: str, role: str, kind: str, path: Path, model, tok) -> TextKV | None:
    ids = np.asarray(tok(ct.SOURCES[name].text(tok))["input_ids"], dtype=np.int64)
    if len(ids) < max(MIN_TOKENS, PREFIX + CONT):
        print(f"skip {name}: {path} has only {len(ids)} tokens", file=sys.stderr)
        return None
    prefix, cont = ids[:PREFIX], ids[PREFIX : PREFIX + CONT]
    k, v = extract_kv(model, prefix)
    t = TextKV(name, role, kind, str(path), len(ids), prefix, cont, f32_to_bf16(k), f32_to_bf16(v))
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f"{name}.tmp.npz"
    np.savez(tmp, prefix_ids=prefix, cont_ids=cont, k=t.k, v=t.v, meta=np.array([role, str(path), len(ids)]))
    os.replace(tmp, CACHE / f"{name}.npz")
    return t


def _load_cached(name: str, kind: str, path: Path) -> TextKV | None:
    f = CACHE / f"{name}.npz"
    if not f.exists():
        return None
    z = np.load(f)
    role, cached_path, total = (str(x) for x in z["meta"])
    if cached_path != str(path):
        return None
    role = "tune" if name in ct.CALIBRATION else "heldout"  # the catalogue decides, not the cache
    return TextKV(name, role, kind, cached_path, int(total), z["prefix_ids"], z["cont_ids"], z["k"], z["v"])


def load_texts(names: list[str] | None = None, model_tok=None) -> list[TextKV]:
    """All available texts (or ``names``), extracting KV on first use."""
    texts = []
    for name, role, kind in TEXT_SOURCES:
        if names and name not in names:
            continue
        path = ct.SOURCES[name].path
        if not path.is_file():
            print(f"skip {name}: {path} does not exist", file=sys.stderr)
            continue
        t = _load_cached(name, kind, path)
        if t is None:
            model_tok = model_tok or load_model()
            t = _extract_one(name, role, kind, path, *model_tok)
        if t is not None:
            texts.append(t)
    return texts


def describe(texts: list[TextKV]) -> list[dict]:
    return [
        {
            "name": t.name,
            "role": t.role,
            "kind": t.kind,
            "path": t.path,
            "total_tokens": t.total_tokens,
            "prefix_tokens": len(t.prefix_ids),
            "cont_tokens": len(t.cont_ids),
        }
        for t in texts
    ]


def cpu_model() -> str:
    """This machine's CPU model name (for benchmark metadata)."""
    try:
        return next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return "unknown"


def cpu_isa() -> list[str]:
    """The vector-ISA flags of this CPU that can change float results (for benchmark metadata)."""
    wanted = {"avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "f16c"}
    try:
        flags = next(
            line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return []
    return sorted(wanted & set(flags))


def main() -> int:
    texts = load_texts()
    for d in describe(texts):
        print(f"{d['name']:22s} {d['role']:8s} {d['kind']:12s} {d['total_tokens']:6d} tokens  {d['path']}")
    if len(texts) < 4:
        print("fewer than 4 real texts found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
