"""Static-model rANS with one distribution per context (a context = one (layer, K/V, channel)).

32-bit states, 16-bit renormalisation words, 4 interleaved states sharing one word stream (ryg_rans
style), ``PROB_BITS``-bit frequencies (each present symbol >= 1). Symbols are coded channel-major
(all tokens of channel 0, then channel 1, ...) so one context's tables stay hot in L1 while decoding.

All hot loops are numba ``@njit(nogil=True)``; decoders never read or write out of bounds on hostile
input and report errors by return code (the callers turn them into ``CorruptChunk``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

PROB_BITS = 12
RANS_L = 1 << 16
NSTATES = 4


@njit(nogil=True, cache=True)
def normalize_counts(counts, prob_bits):
    """counts [N, S] (float64 >= 0) -> freqs [N, S] uint16 summing to 2^prob_bits per row.

    Every symbol with a positive count keeps a frequency >= 1. Rows with no counts get a uniform
    distribution over all S symbols.
    """
    n, s = counts.shape
    total_m = 1 << prob_bits
    out = np.zeros((n, s), np.uint16)
    for r in range(n):
        tot = 0.0
        for j in range(s):
            tot += counts[r, j]
        f = np.zeros(s, np.int64)
        if tot <= 0:
            for j in range(s):
                f[j] = total_m // s
            f[0] += total_m - (total_m // s) * s
        else:
            acc = 0
            for j in range(s):
                if counts[r, j] > 0:
                    f[j] = max(1, int(counts[r, j] * total_m / tot))
                acc += f[j]
            diff = total_m - acc
            while diff != 0:  # give/take one at a time from the largest entries (> 1)
                best = 0
                for j in range(s):
                    if f[j] > f[best]:
                        best = j
                step = diff if diff > 0 else max(diff, 1 - f[best])
                if step == 0:
                    break
                f[best] += step
                diff -= step
        for j in range(s):
            out[r, j] = f[j]
    return out


@njit(nogil=True, cache=True)
def build_cum(freq, prob_bits):
    """freq [N, S] uint16 -> (cum [N, S+1] uint32 encoder table, ok: every row sums to 2^prob_bits)."""
    n, s = freq.shape
    m = 1 << prob_bits
    cum = np.zeros((n, s + 1), np.uint32)
    for r in range(n):
        acc = 0
        for j in range(s):
            cum[r, j] = acc
            acc += int(freq[r, j])
        cum[r, s] = acc
        if acc != m:
            return cum, False
    return cum, True


@njit(nogil=True, cache=True)
def encode(codes, ctx0, freq, cum, prob_bits):
    """codes [T, C] uint8 -> uint16 word stream; channel c uses context ``ctx0 + c``.

    Returns (words, ok); ok is False if a symbol has zero frequency in its context.
    """
    t_n, c_n = codes.shape
    n = t_n * c_n
    buf = np.empty(n * 2 + 2 * NSTATES + 16, np.uint16)
    p = 0
    x = np.full(NSTATES, RANS_L, np.uint64)
    for i in range(n - 1, -1, -1):
        c = i // t_n
        t = i - c * t_n
        s = codes[t, c]
        f = np.uint64(freq[ctx0 + c, s])
        if f == 0:
            return buf[:0], False
        j = i & (NSTATES - 1)
        xj = x[j]
        x_max = np.uint64((RANS_L >> prob_bits) << 16) * f
        while xj >= x_max:
            buf[p] = np.uint16(xj & 0xFFFF)
            p += 1
            xj >>= np.uint64(16)
        x[j] = ((xj // f) << np.uint64(prob_bits)) + (xj % f) + np.uint64(cum[ctx0 + c, s])
    for j in range(NSTATES - 1, -1, -1):
        buf[p] = np.uint16(x[j] & 0xFFFF)
        buf[p + 1] = np.uint16(x[j] >> np.uint64(16))
        p += 2
    return buf[:p][::-1].copy(), True


BUCKET_SHIFT = 4


@njit(nogil=True, cache=True)
def build_decode_tables(freq, prob_bits):
    """freq [N, S] -> (cum16 [N, S+1] uint16, bucket [N, 2^(prob_bits-4)] uint8, ok).

    ``bucket[r, b]`` is the symbol whose range holds slot ``b << 4``; the decoder scans forward from it
    (usually 0-1 steps). ~0.8 KB per context instead of a 4 KB slot->symbol table: decoding is bound
    by cache misses on the tables, so the compact form is ~2x faster end to end.
    """
    n, s = freq.shape
    m = 1 << prob_bits
    nb = m >> BUCKET_SHIFT
    cum = np.zeros((n, s + 1), np.uint16)
    bucket = np.zeros((n, nb), np.uint8)
    if prob_bits > 15 or prob_bits < BUCKET_SHIFT or s > 256:
        return cum, bucket, False
    for r in range(n):
        acc = 0
        for j in range(s):
            cum[r, j] = acc
            f = int(freq[r, j])
            if acc + f > m:
                return cum, bucket, False
            b0 = (acc + (1 << BUCKET_SHIFT) - 1) >> BUCKET_SHIFT
            acc += f
            for b in range(b0, (acc + (1 << BUCKET_SHIFT) - 1) >> BUCKET_SHIFT):
                bucket[r, b] = j
        cum[r, s] = acc
        if acc != m:
            return cum, bucket, False
    return cum, bucket, True


@njit(nogil=True, cache=True)
def decode(words, ctx0, cum, bucket, prob_bits, out):
    """Inverse of ``encode`` into ``out`` [T, C] uint8 with ``build_decode_tables`` tables.

    Returns 0 on success, < 0 on corrupt input. Renormalisation is branchless (the next word is read
    speculatively, clamped in bounds, and consumed only if needed).
    """
    t_n, c_n = out.shape
    n_w = words.shape[0]
    s_max = cum.shape[1] - 2
    if n_w < 2 * NSTATES:
        return -1
    x = np.empty(NSTATES, np.uint32)
    p = 0
    for j in range(NSTATES):
        x[j] = (np.uint32(words[p]) << np.uint32(16)) | np.uint32(words[p + 1])
        p += 2
    mask = np.uint32((1 << prob_bits) - 1)
    pb = np.uint32(prob_bits)
    bs = np.uint32(BUCKET_SHIFT)
    last = n_w - 1
    i = 0
    for c in range(c_n):
        cu = cum[ctx0 + c]
        bk = bucket[ctx0 + c]
        for t in range(t_n):
            j = i & (NSTATES - 1)
            xj = x[j]
            sl = xj & mask
            s = np.int64(bk[sl >> bs])
            while s < s_max and np.uint32(cu[s + 1]) <= sl:
                s += 1
            lo = np.uint32(cu[s])
            xj = (np.uint32(cu[s + 1]) - lo) * (xj >> pb) + sl - lo
            need = xj < RANS_L
            w = np.uint32(words[min(p, last)])
            xj = ((xj << np.uint32(16)) | w) if need else xj
            p += need
            x[j] = xj
            out[t, c] = s
            i += 1
    if p != n_w:
        return -3
    for j in range(NSTATES):
        if x[j] != RANS_L:
            return -4
    return 0
