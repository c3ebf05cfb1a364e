"""KVTC re-implemented as a peer row (benchmark only): Staniszewski & Lancucki, "KV Cache Transform Coding
for Compact Storage in LLM Inference" (ICLR 2026).

What it does, as published: RoPE undone on keys; a PCA basis fitted once on calibration KV (mean-centred;
attention-sink tokens left out); a bit budget spread over the principal components by dynamic
programming that minimises sum_i lambda_i 4^-b_i (lambda_i the component variances; trailing components
get 0 bits, i.e. are dropped); each kept component quantized uniformly to b_i bits between its min and
max over the chunk (scale and shift stored in fp16); the packed symbols Deflated (nvCOMP on a GPU, isal
here). Its defaults keep the s = 4 first tokens (sinks) and the w = 128 most recent tokens exact.

Here, per layer and K/V (all KV heads concatenated, like KVTC's per-layer variant), on the same tune texts
our calibration uses. Deviations, stated: a prefix tier stores chunks, which have no "recent" tokens, so
the window is not applied (it would exempt the last 128 tokens of *every* 256-token chunk); the sink
exemption applies to the first chunk of a sequence (positions 0-3). Symbols are stored byte-aligned before
Deflate (Deflate's Huffman stage removes the unused high bits). The DP over a separable convex objective
is done greedily (one bit at a time to the largest marginal gain), which gives the same allocation.
"""

from __future__ import annotations

import struct

import numpy as np

from benchmarks import kvdata
from sgl_remote_kv.codec import lz, transform_ops
from sgl_remote_kv.types import RopeSpec

SINKS = 4
MAX_BITS = 8


def _unrope(x: np.ndarray, rope: RopeSpec, start: int) -> np.ndarray:
    x = np.array(x, np.float32)
    transform_ops.apply_rope(x, rope, start, -1.0)
    return x


def _rope(x: np.ndarray, rope: RopeSpec, start: int) -> np.ndarray:
    x = np.array(x, np.float32)
    transform_ops.apply_rope(x, rope, start, 1.0)
    return x


def allocate(var: np.ndarray, budget: int) -> np.ndarray:
    """Bits per component minimising sum var_i 4^-b_i with sum b_i <= budget, 0 <= b_i <= MAX_BITS."""
    bits = np.zeros(var.size, np.int64)
    gain = var * 0.75  # reduction of var * 4^-b when b goes from 0 to 1
    for _ in range(budget):
        i = int(np.argmax(gain))
        if gain[i] <= 0:
            break
        bits[i] += 1
        gain[i] = -1.0 if bits[i] >= MAX_BITS else gain[i] / 4
    return bits


class KVTC:
    """Fitted on ``texts`` (``kvdata.TextKV``, bf16 KV with RoPE); ``bits`` = average bits per value."""

    def __init__(self, texts, rope: RopeSpec, bits: float) -> None:
        self.rope, self.bits = rope, bits
        n_l, _, h, d = texts[0].k.shape
        self.c, self.shape = h * d, (n_l, h, d)
        self.mean = np.zeros((n_l, 2, self.c), np.float32)
        self.basis = np.zeros((n_l, 2, self.c, self.c), np.float32)
        self.alloc = np.zeros((n_l, 2, self.c), np.int64)
        for layer in range(n_l):
            for kv in range(2):
                xs = []
                for t in texts:
                    x = kvdata.to_f32((t.k if kv == 0 else t.v)[layer])
                    x = _unrope(x, rope, 0) if kv == 0 else x
                    xs.append(x[SINKS:].reshape(x.shape[0] - SINKS, -1))
                x = np.concatenate(xs).astype(np.float64)
                mu = x.mean(0)
                w, vecs = np.linalg.eigh(np.cov((x - mu).T))
                order = np.argsort(w)[::-1]
                self.mean[layer, kv], self.basis[layer, kv] = mu, vecs[:, order]
                self.alloc[layer, kv] = allocate(np.maximum(w[order], 0), int(round(bits * self.c)))

    def encode(self, k: np.ndarray, v: np.ndarray, start: int) -> bytes:
        n_l, t_n, h, d = k.shape
        sinks = max(0, min(SINKS - start, t_n))
        parts = [struct.pack("<III", t_n, sinks, start)]
        for layer in range(n_l):
            for kv, a in enumerate((k, v)):
                x = kvdata.to_f32(a[layer])
                parts.append(a[layer, :sinks].tobytes())  # exact sinks (bf16 bits)
                x = _unrope(x, self.rope, start) if kv == 0 else x
                y = (x[sinks:].reshape(t_n - sinks, -1) - self.mean[layer, kv]) @ self.basis[layer, kv]
                b = self.alloc[layer, kv]
                keep = np.nonzero(b)[0]
                lo = y[:, keep].min(0).astype(np.float16)
                hi = y[:, keep].max(0).astype(np.float16)
                levels = (1 << b[keep]) - 1
                span = np.maximum(hi.astype(np.float32) - lo.astype(np.float32), 1e-12)
                q = np.rint((y[:, keep] - lo.astype(np.float32)) / span * levels)
                q = np.clip(q, 0, levels).astype(np.uint8)
                parts += [lo.tobytes(), hi.tobytes(), np.ascontiguousarray(q.T).tobytes()]
        raw = b"".join(parts)
        return lz.compress(lz.DEFLATE, raw, 1) + struct.pack("<I", len(raw))

    def decode(self, blob: bytes) -> tuple[np.ndarray, np.ndarray]:
        (raw_len,) = struct.unpack("<I", blob[-4:])
        out = np.empty(raw_len, np.uint8)
        lz.decompress_into(lz.DEFLATE, blob[:-4], out, raw_len)
        buf = out.tobytes()
        n_l, h, d = self.shape
        t_n, sinks, start = struct.unpack_from("<III", buf, 0)
        o = 12
        res = [np.empty((n_l, t_n, h, d), np.uint16) for _ in range(2)]
        for layer in range(n_l):
            for kv in range(2):
                sk = np.frombuffer(buf, np.uint16, sinks * h * d, o).reshape(sinks, h, d)
                o += sk.nbytes
                b = self.alloc[layer, kv]
                keep = np.nonzero(b)[0]
                lo = np.frombuffer(buf, np.float16, keep.size, o).astype(np.float32)
                hi = np.frombuffer(buf, np.float16, keep.size, o + 2 * keep.size).astype(np.float32)
                o += 4 * keep.size
                q = np.frombuffer(buf, np.uint8, keep.size * (t_n - sinks), o).reshape(keep.size, -1).T
                o += q.size
                levels = (1 << b[keep]) - 1
                y = np.zeros((t_n - sinks, self.c), np.float32)
                y[:, keep] = lo + q.astype(np.float32) / levels * np.maximum(hi - lo, 0)
                x = (y @ self.basis[layer, kv].T + self.mean[layer, kv]).reshape(t_n - sinks, h, d)
                x = _rope(x, self.rope, start + sinks) if kv == 0 else x
                res[kv][layer, :sinks] = sk
                res[kv][layer, sinks:] = kvdata.f32_to_bf16(x)
        return res[0], res[1]
