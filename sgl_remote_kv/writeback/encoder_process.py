"""One write-back encoder process: ``python -m sgl_remote_kv.writeback.encoder_process --sock FD --slot FD``.

Started by ``encoders.EncoderPool`` (never by hand) with two inherited descriptors: ``--sock``, its end of a
Unix stream socket, and ``--slot``, the shared memory file the host writes each chunk's KV into (``wire.py``
says what goes where). It reads ``Hello``, lowers its priority by ``Hello.nice``, builds the codec and maps
the slot, answers ``Ready`` (with ``error`` and exit status 2 when it cannot), then answers each ``Encode``
with ``Encoded``: the bytes ``Codec.encode`` returns and the CPU time it took, or the codec's refusal in
words. The host closing the
socket (or dying) ends it with status 0; a frame that is not ours ends it with status 2.

Imports neither torch nor SGLang: numpy, numba and the codec only.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import socket
import sys
import time

import numpy as np

from sgl_remote_kv.codec.base import codec_from_params
from sgl_remote_kv.types import ModelFingerprint, numpy_storage_dtype
from sgl_remote_kv.writeback import wire


def _codec(hello: wire.Hello):
    fp = ModelFingerprint.from_canonical(hello.fingerprint)
    return codec_from_params(hello.codec, hello.codec_params.encode()), fp


def serve(sock: socket.socket, slot_fd: int) -> int:
    """The conversation of ``wire.py`` on ``sock``; the exit status."""
    try:
        hello = wire.recv(sock)
    except (EOFError, OSError, wire.WireError):
        return 2
    if not isinstance(hello, wire.Hello):
        return 2
    if hello.nice:
        os.nice(hello.nice)
    try:
        codec, fp = _codec(hello)
        slot = mmap.mmap(slot_fd, hello.slot_bytes)
    except (
        KeyError,
        TypeError,
        ValueError,
        OSError,
        ArithmeticError,
    ) as e:  # unknown codec/calibration, bad params
        wire.send(sock, wire.Ready(error=f"{type(e).__name__}: {e}"[:4096]))
        return 2
    wire.send(sock, wire.Ready())
    lay = fp.layout
    dtype = numpy_storage_dtype(lay.dtype)
    mem = np.frombuffer(slot, np.uint8)
    while True:
        try:
            msg = wire.recv(sock)
        except (EOFError, ConnectionError):
            return 0
        except wire.WireError:
            return 2
        if not isinstance(msg, wire.Encode):
            return 2
        shape = (lay.num_layers, msg.tokens, lay.num_kv_heads, lay.head_dim)
        n = math.prod(shape) * dtype.itemsize
        if 2 * n > hello.slot_bytes:
            wire.send(sock, wire.Encoded(error=f"{msg.tokens} tokens do not fit the slot"))
            continue
        k = mem[:n].view(dtype).reshape(shape)
        v = mem[n : 2 * n].view(dtype).reshape(shape)
        t0 = time.process_time()
        try:
            blob = codec.encode(k, v, fp, start=msg.start)
            reply = wire.Encoded(blob=blob, cpu_s=max(0.0, time.process_time() - t0))
        except Exception as e:  # process boundary: the host counts the chunk's failure and logs it
            reply = wire.Encoded(error=f"{type(e).__name__}: {e}"[:4096])
        wire.send(sock, reply)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sock", type=int, required=True, help="inherited socket descriptor")
    ap.add_argument("--slot", type=int, required=True, help="inherited shared memory descriptor")
    ns = ap.parse_args(argv)
    with socket.socket(fileno=ns.sock) as sock:
        return serve(sock, ns.slot)


if __name__ == "__main__":
    sys.exit(main())
