"""Trellis-coded ("dependent") quantization for the transform codec (``quantizer=trellis``), as in H.266/VVC.

Two scalar quantizers on a grid of DELTA (in units of a value's step): Q0 reconstructs k as 2k DELTA, Q1 as
(2k - sign(k)) DELTA; a 4-state machine, driven by the parity of each k along a component's tokens (from
state 0 at a chunk's first token), says which one codes the next value (states 0-1: Q0, 2-3: Q1). The
encoder (``quantize``) picks the k sequence by a Viterbi search minimizing squared error + LAMBDA x bits (a
per-component rate model from the chunk's own values); the decoder (``replay``) only replays the state
machine into the integer codes r every dequant path reads (a value = r x DELTA x step x scale).

Stateless numba kernels (GIL released); they write only the arrays they are given.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.codec.transform_ops import ESC, ZERO

NEXT = np.array([[0, 2], [2, 0], [1, 3], [3, 1]], np.int64)  # next state by (state, k & 1)
DELTA = 0.6  # the grid, in units of the step (KL at or under rint's at the same steps: docs/CODEC.md)
LAMBDA = 0.1  # squared error (in steps^2) one bit is worth
MAX_K = 16383  # |r| = |2k - sign(k)| <= 32767 fits an int16 escape
# per state: the two (previous state, parity of k) that lead to it
_PRED = np.array(
    [[(st, p) for st in range(4) for p in range(2) if NEXT[st, p] == ns] for ns in range(4)], np.int64
)
_LITTLE_ENDIAN = sys.byteorder == "little"  # ``_quantizers_swar`` reads 8 tokens a word, token t in byte t


@njit(nogil=True, cache=True)
def quantize(y, steps, scale, delta, lam, sym, esc):
    """``transform_ops.quantize``'s contract (Deflate: no tables) with trellis-coded k in place of rint: ``sym`` [H*D, T]
    holds k + ZERO or ESC (k to ``esc``); returns the escape count, -1 when ``esc`` is too small, -2 when
    a value is beyond what MAX_K codes (or not finite). Tokens of scale 0 (exact sinks) get k = 0.

    Per component: a rate model (bits of each k from a histogram of rint(u / 2 DELTA) over the chunk's
    tokens, where u = y / (step x scale)), then a Viterbi search over the 4 states with 3 candidates per
    quantizer (its two levels around u, and 0): the cheaper of each parity, then per state the cheaper of its
    two ways in."""
    h_n, t_n, d = y.shape
    inf = np.float64(1e300)
    inv2d, invd = 1.0 / (2.0 * delta), 1.0 / delta
    u = np.empty(t_n, np.float64)
    cnt = np.empty(256, np.float64)
    bits = np.empty(256, np.float64)
    cost = np.empty(4, np.float64)
    nxt = np.empty(4, np.float64)
    back_s = np.empty((t_n, 4), np.int8)
    back_k = np.empty((t_n, 4), np.int32)
    ks = np.empty(t_n, np.int64)
    bc = np.empty((2, 2), np.float64)  # per quantizer and parity: the cheapest candidate's cost
    bk = np.empty((2, 2), np.int64)  # and its k
    n = 0
    for h in range(h_n):
        for j in range(d):
            c = h * d + j
            inv = 1.0 / np.float64(steps[h, j])
            cnt[:] = 0.5
            for t in range(t_n):
                u[t] = 0.0
                if scale[t] > 0:
                    u[t] = np.float64(y[h, t, j]) * inv / np.float64(scale[t])
                if not abs(u[t]) * inv2d < MAX_K - 1:  # (NaN too) no k can code it
                    return -2
                k0 = np.int64(np.rint(u[t] * inv2d))
                if -127 <= k0 <= 127:
                    cnt[k0 + ZERO] += 1.0
            tot = cnt.sum()
            unseen = -np.log2(0.5 / tot)
            for i in range(256):
                bits[i] = unseen if cnt[i] == 0.5 else -np.log2(cnt[i] / tot)
            esc_bits = 16.0 + bits[ESC]
            cost[:] = inf
            cost[0] = 0.0
            for t in range(t_n):
                x = u[t]
                # per quantizer q and parity p: the cheapest candidate k (of the levels below and above u,
                # one is even and one odd; 0 is even)
                zc = x * x + lam * bits[ZERO]
                for q in range(2):
                    bc[q, 0], bk[q, 0], bc[q, 1], bk[q, 1] = zc, 0, inf, 0
                    if scale[t] <= 0:
                        continue
                    if q == 0:
                        b = np.int64(np.floor(x * inv2d))
                    else:
                        b = np.int64(np.floor((abs(x) * invd + 1.0) * 0.5))
                        if x < 0:
                            b = -b - 1  # levels -b-1 (below) and -b (above)
                    for k in range(b, b + 2):
                        if k == 0:
                            continue
                        r = 2 * k - (q if k > 0 else -q)
                        e = x - r * delta
                        cc = e * e + lam * (bits[k + ZERO] if -127 <= k <= 127 else esc_bits)
                        p = k & 1
                        if p == 1 or cc < bc[q, 0]:
                            bc[q, p] = cc
                            bk[q, p] = k
                # each state has two ways in (``_PRED``): keep the cheaper
                for ns in range(4):
                    s0, p0 = _PRED[ns, 0, 0], _PRED[ns, 0, 1]
                    s1, p1 = _PRED[ns, 1, 0], _PRED[ns, 1, 1]
                    c0 = cost[s0] + bc[s0 >> 1, p0]
                    c1 = cost[s1] + bc[s1 >> 1, p1]
                    if c1 < c0:
                        nxt[ns] = c1
                        back_s[t, ns] = s1
                        back_k[t, ns] = bk[s1 >> 1, p1]
                    else:
                        nxt[ns] = c0
                        back_s[t, ns] = s0
                        back_k[t, ns] = bk[s0 >> 1, p0]
                cost[:] = nxt
            st = 0
            for i in range(1, 4):
                if cost[i] < cost[st]:
                    st = i
            for t in range(t_n - 1, -1, -1):
                ks[t] = back_k[t, st]
                st = back_s[t, st]
            for t in range(t_n):
                k = ks[t]
                if -127 <= k <= 127:
                    sym[c, t] = k + ZERO
                else:
                    if n >= esc.shape[0]:
                        return -1
                    esc[n] = k
                    n += 1
                    sym[c, t] = ESC
    return n


@njit(nogil=True, cache=True)
def _row_needs_care(srow):
    """Whether a component's symbols hold an escape or a k with |k| >= 64 (only those codes can need one)."""
    acc = np.uint8(0)
    for t in range(srow.shape[0]):
        acc |= np.uint8(np.uint8(srow[t] - np.uint8(ZERO - 63)) > np.uint8(126))
    return acc != 0


@njit(nogil=True, cache=True)
def _quantizers(srow, esc, e_in, qrow):
    """``qrow`` = the quantizer (0 or 1) of each token of one component, its escaped k from ``esc[e_in]`` on.
    The state machine in closed form: with state = 2 b1 + b0, ``NEXT`` is b0' = b1, b1' = b0 ^ parity(k), so
    the quantizer of token t (b1, from state 0) is q_t = parity(k_(t-1)) ^ q_(t-2), q_0 = q_(-1) = 0."""
    a = np.uint8(0)
    b = np.uint8(0)
    for t in range(srow.shape[0]):
        qrow[t] = a
        s = srow[t]
        p = s & np.uint8(1)  # the parity of k = s - ZERO (ZERO is even)
        if s == ESC:
            p = np.uint8(esc[e_in] & 1)
            e_in += 1
        nb = p ^ b
        b = a
        a = nb


@njit(nogil=True, cache=True)
def _quantizers_swar(sym, q):
    """``_quantizers`` of every component as if no k were escaped, 8 tokens a 64-bit word (T a multiple of
    8, C-contiguous, little-endian): y_t = parity(k_(t-1)) bytewise, its stride-2 prefix XOR within the word
    by doubling, then XOR the carry (each byte class's last q of the words before: one XOR a word)."""
    c_n, t_n = sym.shape
    sw = sym.reshape(c_n * t_n).view(np.uint64).reshape(c_n, t_n // 8)
    qw = q.reshape(c_n * t_n).view(np.uint64).reshape(c_n, t_n // 8)
    ones = np.uint64(0x0101010101010101)
    pair = np.uint64(0x0001000100010001)  # bytes 6 and 7 of a word broadcast to every (even, odd) pair
    for c in range(c_n):
        prev = np.uint64(0)
        carry = np.uint64(0)
        for i in range(t_n // 8):
            p = sw[c, i] & ones
            y = (p << np.uint64(8)) | (prev >> np.uint64(56))  # little-endian: byte t holds token t's
            prev = p
            y ^= y << np.uint64(16)
            y ^= y << np.uint64(32)
            qw[c, i] = y ^ carry
            carry ^= ((y >> np.uint64(48)) & np.uint64(0xFFFF)) * pair


@njit(nogil=True, cache=True)
def codes(sym, esc, out_sym, out_esc):
    """Replay the trellis: ``sym`` [C, T] (k + ZERO or ESC, k from ``esc`` in order) -> ``out_sym`` /
    ``out_esc`` in ``transform_ops.quantize``'s form of the integer codes r (a value = r x DELTA x step x scale).
    Returns the escapes written (``out_esc`` int16, as many as ``sym`` has values), -1 when ``esc`` does not
    hold exactly the escaped values, -2 when an r does not fit int16 (not written by ``quantize``).

    Passes over the whole block (each one vectorizes or is one XOR per value): the escape count, every
    component's quantizers (``_quantizers``, branch-free, as if no k were escaped), r + ZERO = 2k - q sign(k)
    + ZERO elementwise; then, value by value, only the components holding an escape (their quantizers
    redone with the escaped k) or a |k| >= 64: the only ones whose codes can need an escape."""
    c_n, t_n = sym.shape
    n_esc = 0
    for c in range(c_n):
        srow = sym[c]
        for t in range(t_n):
            n_esc += srow[t] == ESC
    if n_esc != esc.shape[0]:
        return -1
    q = np.empty((c_n, t_n), np.uint8)
    if t_n % 8 == 0 and _LITTLE_ENDIAN:
        _quantizers_swar(np.ascontiguousarray(sym), q)  # (a view of a C-contiguous block: no copy)
    else:
        for c in range(c_n):
            srow, qrow = sym[c], q[c]
            a = np.uint8(0)
            b = np.uint8(0)
            for t in range(t_n):  # ``_quantizers`` without its escape test
                qrow[t] = a
                nb = (srow[t] & np.uint8(1)) ^ b
                b = a
                a = nb
    for c in range(c_n):  # r + ZERO, wrapped to a byte where r needs an escape (rewritten below)
        srow, qrow, orow = sym[c], q[c], out_sym[c]
        for t in range(t_n):
            s = np.int32(srow[t])
            qq = np.int32(qrow[t])
            orow[t] = np.uint8(2 * s - ZERO - (qq if s > ZERO else 0) + (qq if s < ZERO else 0))
    n = 0
    e_in = 0
    for c in range(c_n):
        srow = sym[c]
        if not _row_needs_care(srow):
            continue
        row_esc = 0
        for t in range(t_n):
            row_esc += srow[t] == ESC
        if row_esc:
            _quantizers(srow, esc, e_in, q[c])
        for t in range(t_n):
            s = np.int32(srow[t])
            k = s - ZERO
            if s == ESC:
                k = np.int32(esc[e_in])
                e_in += 1
            r = 2 * k - np.int32(q[c, t]) * (np.int32(k > 0) - np.int32(k < 0))
            if -127 <= r <= 127:
                out_sym[c, t] = r + ZERO
            else:
                if r < -32768 or r > 32767:
                    return -2
                out_esc[n] = r
                n += 1
                out_sym[c, t] = ESC
    return n


def check_escapes(esc) -> None:
    """``CorruptChunk`` when an escaped k is beyond what ``quantize`` writes (|k| <= MAX_K): the one bound
    on a section's k that the host's replay (int16 codes) and a device's (float) would otherwise apply
    differently."""
    if esc.size and int(np.abs(esc.astype(np.int32)).max()) > MAX_K:
        raise CorruptChunk(f"a trellis escape is beyond |k| <= {MAX_K}")


def replay(sym, esc, nk):
    """A trellis section's k -> the integer codes the CPU dequant stage reads: ``sym`` [2, C, T] k symbols,
    ``esc`` (K's ``nk`` first) -> (code symbols, their escapes, K's escape count), new arrays (the decoded
    buffer is not written); ``CorruptChunk`` when they disagree."""
    check_escapes(esc)
    out = np.empty(sym.shape, np.uint8)
    escs = []
    for kv, e in enumerate((esc[:nk], esc[nk:])):
        buf = np.empty(sym.shape[1] * sym.shape[2], np.int16)
        n = codes(sym[kv], e, out[kv], buf)
        if n < 0:
            raise CorruptChunk(f"trellis symbols do not match their escapes ({n})")
        escs.append(buf[:n])
    return out, np.concatenate(escs), escs[0].size
