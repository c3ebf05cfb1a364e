import json
from pathlib import Path

from sgl_remote_kv.model import ensure_model, find_gguf, weights_identity


def test_gguf_comes_from_the_wheel():
    gguf = find_gguf()
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000


def test_built_dir_is_an_ordinary_hf_model(model_dir):
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (30, 3)
    assert "quantization_config" not in cfg
    assert (d / "tokenizer.json").exists() and list(d.glob("*.safetensors"))


def test_ensure_model_is_idempotent(model_dir):
    before = Path(model_dir, "model.safetensors").stat().st_mtime_ns
    assert str(ensure_model("float32")) == model_dir
    assert Path(model_dir, "model.safetensors").stat().st_mtime_ns == before


def test_weights_identity_is_stable_and_content_sensitive(model_dir, tmp_path):
    a = weights_identity(Path(model_dir))
    assert a == weights_identity(Path(model_dir)) and len(a) == 64
    (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      ")
    assert weights_identity(tmp_path) != a
