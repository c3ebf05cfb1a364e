"""The adaptive-resolution decode profile (``nvdec/profile.py``) of the server's default settings, measured
on pre-encoded sample chunks, so a machine that cannot encode (the GPU image has no PyAV/libx265) times
NVDEC on exactly the blobs the CPU twin times with FFmpeg's software HEVC.

    python -m benchmarks.nvdec_device_profile encode DIR                 # where PyAV is (here)
    python -m benchmarks.nvdec_device_profile profile DIR --device cpu  --json a.json
    python -m benchmarks.nvdec_device_profile profile DIR --device cuda --json b.json   # on a GPU

``encode`` writes what ``serving_table`` profiles at start-up for SmolLM2-135M's KV layout: sample
chunks of one layer group (synthetic KV, fixed seeds) at each of ``RemoteKVConfig().nvdec_versions``,
``chunk_size`` tokens, with a manifest. ``profile`` decodes them on a real ``DecoderPool`` for each
instance count (``profile.profile``: per-resolution latency per load, switch penalty), scales by the
model's group count as the server does, and prints and writes the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

# SmolLM2-135M (FACTS.md): 30 layers, 3 KV heads of 64, bfloat16.
MODEL_LAYOUT = (30, 3, 64, "bfloat16")
SAMPLES = 2


def _model_fp():
    from sgl_remote_kv.types import KVLayout, ModelFingerprint

    return ModelFingerprint("LlamaForCausalLM", KVLayout(*MODEL_LAYOUT), "nvdec-profile")


def encode(out: Path) -> None:
    from sgl_remote_kv.nvdec.hevc_codec import HevcCodec
    from sgl_remote_kv.nvdec.profile import sample_chunks

    from sgl_remote_kv.config import RemoteKVConfig

    cfg = RemoteKVConfig()
    anchor = HevcCodec()
    out.mkdir(parents=True, exist_ok=True)
    _, blobs = sample_chunks(anchor, cfg.nvdec_versions, _model_fp(), cfg.chunk_size, SAMPLES)
    files = {}
    for res, chunks in blobs.items():
        files[str(res)] = [f"r{res}_s{i}.chunk" for i in range(len(chunks))]
        for name, blob in zip(files[str(res)], chunks, strict=True):
            (out / name).write_bytes(blob)
    manifest = {
        "chunk_size": cfg.chunk_size,
        "layout": MODEL_LAYOUT,
        "anchor": anchor.params(),
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"wrote {sum(map(len, files.values()))} chunks at resolutions {list(files)} to {out}")


def profile_dir(src: Path, device: str, instances: list[int], repeats: int) -> dict:
    import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")
    from sgl_remote_kv.nvdec.hevc_codec import GROUP
    from sgl_remote_kv.nvdec.pool import DecoderPool
    from sgl_remote_kv.nvdec.profile import device_name, discard_sink, group_fingerprint, per_model, profile
    from sgl_remote_kv.nvdec.video import decoder_name

    manifest = json.loads((src / "manifest.json").read_text())
    if tuple(manifest["layout"]) != MODEL_LAYOUT:
        raise SystemExit(f"{src}: encoded for layout {manifest['layout']}, not {MODEL_LAYOUT}")
    fp = group_fingerprint(_model_fp())
    blobs = {int(r): [(src / n).read_bytes() for n in names] for r, names in manifest["files"].items()}
    groups = -(-MODEL_LAYOUT[0] // GROUP)
    runs = []
    for n in instances:
        t0 = time.perf_counter()
        with DecoderPool(instances=n, device=device) as pool:
            for r in blobs:  # warm-up: the first decode opens the decoder session (NVDEC: a context)
                profile(pool, fp, {r: blobs[r][:1]}, discard_sink, repeats=1)
            t = profile(pool, fp, blobs, discard_sink, repeats=repeats)
            errors = dict(pool.stats)
        # latencies of the model's whole chunk (as the server's table); group_bytes below stay per group
        model = per_model(t, MODEL_LAYOUT[0])
        runs.append(
            {
                "instances": n,
                "resolutions": ["full" if r == 0 else r for r in t.resolutions],
                "decode_s_per_chunk": {  # [resolution][load 1..instances], the model's whole chunk
                    ("full" if r == 0 else str(r)): [round(x, 5) for x in row]
                    for r, row in zip(t.resolutions, model.latency, strict=True)
                },
                # once per chunk, not per group: a chunk is one pool job on one decoder (``per_model``)
                "switch_penalty_s": {
                    ("full" if r == 0 else str(r)): round(p, 5)
                    for r, p in zip(t.resolutions, t.penalty, strict=True)
                },
                "group_bytes": {
                    ("full" if r == 0 else str(r)): s
                    for r, s in zip(t.resolutions, t.size_bytes, strict=True)
                },
                "pool_stats": errors,
                "profile_s": round(time.perf_counter() - t0, 2),
            }
        )
    return {
        "what": "benchmarks/nvdec_device_profile.py: the server's adaptive-resolution decode table "
        "(nvdec/profile.py) on pre-encoded chunks of SmolLM2-135M's layout, per decoder instance count",
        "device": device,
        "device_name": device_name(device),
        "decoder": decoder_name(device),
        "host": platform.node(),
        "chunk_size": manifest["chunk_size"],
        "layer_groups": groups,
        "repeats": repeats,
        "runs": runs,
    }


def _print(rep: dict) -> None:
    print(
        f"{rep['decoder']} on {rep['device_name']}: decode s per {rep['chunk_size']}-token chunk (30 layers)"
    )
    for run in rep["runs"]:
        print(f"  instances {run['instances']} ({run['profile_s']} s to profile)")
        for res, row in run["decode_s_per_chunk"].items():
            loads = "  ".join(f"L{i + 1} {x * 1e3:8.2f} ms" for i, x in enumerate(row))
            print(f"    {res:>5}: {loads}   switch +{run['switch_penalty_s'][res] * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("encode")
    e.add_argument("dir", type=Path)
    p = sub.add_parser("profile")
    p.add_argument("dir", type=Path)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--instances", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.cmd == "encode":
        encode(a.dir)
        return
    rep = profile_dir(a.dir, a.device, a.instances, a.repeats)
    _print(rep)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
