"""Prefix-chain chunk keys and namespaces."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from sgl_remote_kv.store.keys import chunk_keys, namespace
from sgl_remote_kv.types import KVLayout, ModelFingerprint

FP = ModelFingerprint("LlamaForCausalLM", KVLayout(30, 3, 64, "bfloat16"), "ab" * 32)
NS = namespace(FP, "int8-zstd", "level=3", None)


def test_chain_matches_reference_definition() -> None:
    ids = list(range(10))
    keys = chunk_keys(NS, ids, 4)
    h0 = hashlib.sha256(NS + np.array([0, 1, 2, 3], "<u4").tobytes()).digest()
    h1 = hashlib.sha256(h0 + np.array([4, 5, 6, 7], "<u4").tobytes()).digest()
    assert keys == [h0, h1]  # the partial chunk [8, 9] gets no key
    assert all(len(k) == 32 for k in keys)


def test_equal_prefixes_equal_keys_and_divergence() -> None:
    a = chunk_keys(NS, list(range(100)), 16)
    b = chunk_keys(NS, list(range(40)) + [999] * 60, 16)
    assert len(a) == 6 and len(b) == 6
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # a key names its whole prefix


def test_list_and_numpy_inputs_agree() -> None:
    ids = [5, 70000, 2**32 - 1, 0] * 8
    for dtype in (np.int32, np.int64, np.uint32):
        if dtype is np.int32:
            continue  # 2**32-1 does not fit int32
        assert chunk_keys(NS, np.array(ids, dtype=dtype), 8) == chunk_keys(NS, ids, 8)


def test_short_input_has_no_keys() -> None:
    assert chunk_keys(NS, [1, 2, 3], 4) == []
    assert chunk_keys(NS, [], 4) == []


@pytest.mark.parametrize(
    ("ids", "chunk", "match"),
    [([1, -1], 1, "uint32"), ([2**32], 1, "uint32"), ([1.5, 2.0], 1, "integers"), ([1, 2], 0, "positive")],
)
def test_invalid_inputs(ids, chunk, match) -> None:
    with pytest.raises(ValueError, match=match):
        chunk_keys(NS, ids, chunk)


def test_namespace_separates_everything_that_makes_kv_incompatible() -> None:
    variants = {
        "base": namespace(FP, "int8-zstd", "level=3"),
        "tenant": namespace(FP, "int8-zstd", "level=3", "tenant-a"),
        "tenant2": namespace(FP, "int8-zstd", "level=3", "tenant-b"),
        "empty-tenant": namespace(FP, "int8-zstd", "level=3", ""),
        "codec": namespace(FP, "int4-zstd", "level=3"),
        "params": namespace(FP, "int8-zstd", "level=4"),
        "params-bytes": namespace(FP, "int8-zstd", b"level=4"),
        "tp": namespace(
            ModelFingerprint(FP.architecture, FP.layout, FP.weights_id, 1, 2), "int8-zstd", "level=3"
        ),
        "dtype": namespace(
            ModelFingerprint(FP.architecture, KVLayout(30, 3, 64, "float16"), FP.weights_id),
            "int8-zstd",
            "level=3",
        ),
        "weights": namespace(ModelFingerprint(FP.architecture, FP.layout, "cd" * 32), "int8-zstd", "level=3"),
        # field boundaries are length-prefixed: moving bytes between codec id and params changes the key
        "boundary": namespace(FP, "int8-zstdl", "evel=3"),
        # a --remote-kv-flush tier flush: a new store generation retires every earlier key
        "generation": namespace(FP, "int8-zstd", "level=3", None, b"\x01" * 16),
        "generation2": namespace(FP, "int8-zstd", "level=3", None, b"\x02" * 16),
    }
    assert namespace(FP, "int8-zstd", "level=3", None, b"") == variants["base"]  # generation 0: old keys
    assert variants["params"] == variants["params-bytes"]  # str and bytes params are the same params
    del variants["params-bytes"]
    assert len(set(variants.values())) == len(variants)
    assert variants["base"] == NS
    ids = list(range(64))
    assert chunk_keys(variants["tenant"], ids, 32) != chunk_keys(variants["tenant2"], ids, 32)


def test_generation_key_is_per_fingerprint_and_never_a_namespace() -> None:
    from sgl_remote_kv.store.keys import generation_key

    other = ModelFingerprint(FP.architecture, FP.layout, FP.weights_id, 1, 2)
    assert generation_key(FP) == generation_key(FP) != generation_key(other)
    assert len(generation_key(FP)) == 32 and generation_key(FP) != namespace(FP, "int8-zstd", "level=3")


def test_keys_are_stable_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from sgl_remote_kv.store.keys import chunk_keys, namespace\n"
        "from sgl_remote_kv.types import KVLayout, ModelFingerprint\n"
        "fp = ModelFingerprint('LlamaForCausalLM', KVLayout(30, 3, 64, 'bfloat16'), 'ab' * 32)\n"
        "print(chunk_keys(namespace(fp, 'int8-zstd', 'level=3', None), list(range(100)), 16)[-1].hex())\n"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert outs == {chunk_keys(NS, list(range(100)), 16)[-1].hex() + "\n"}
