"""KVFetcher's codec-friendly video layout (paper §3.2): quantized KV codes -> yuv444p frames and back.

Inter-frame layout (§3.2.1): a chunk of ``T`` tokens is sliced along the token dimension; three
consecutive layers become the three planes (Y, U, V) of one video (K and V are separate videos). The
tokens are split into groups of ``F`` consecutive tokens (``F`` = number of frames); token
``t = g * F + f`` goes to frame ``f`` at grid position ``g``. Adjacent tokens therefore sit at identical
positions on consecutive frames, so inter prediction references the previous token.

Intra-frame layout (§3.2.2): one token of one layer (``H`` heads x ``D`` dims) becomes a 2-D block. Rules
from the paper: heads stay intact, element order within a head is kept (a head's ``D`` values are a
row-major ``dr x dc`` tile), heads keep their order (row-major on an ``hr x hc`` head grid). Only the
geometric tiling ``(hr, hc, dr, dc)`` is searched (``search.py``-style in :func:`candidate_tilings`).

"Resolution" = tokens per frame: fewer tokens per frame -> smaller frames, more of them. Frames are
padded (a constant, so inter frames skip it) to at least ``min_side`` x ``min_side`` (NVENC refuses < 256x256) and to even
sizes. All functions are pure numpy, called from whichever thread encodes/decodes; they return new arrays
(or views of their input) and keep no references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALIGN = 8
PAD_VALUE = 128
X265_MIN_SIDE = 16  # libx265 refuses frames with a side < 16
NVENC_MIN_SIDE = 256


def _divisor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


@dataclass(frozen=True)
class Tiling:
    """Geometric tiling of one token-layer: ``hr x hc`` heads, each a row-major ``dr x dc`` tile."""

    hr: int
    hc: int
    dr: int
    dc: int

    @classmethod
    def parse(cls, spec: str) -> Tiling:
        """``"1x3/8x8"`` -> Tiling(1, 3, 8, 8)."""
        heads, _, dims = spec.partition("/")
        hr, hc = (int(x) for x in heads.split("x"))
        dr, dc = (int(x) for x in dims.split("x"))
        return cls(hr, hc, dr, dc)

    def spec(self) -> str:
        return f"{self.hr}x{self.hc}/{self.dr}x{self.dc}"

    @property
    def block(self) -> tuple[int, int]:
        return self.hr * self.dr, self.hc * self.dc

    def check(self, heads: int, dim: int) -> None:
        if (
            min(self.hr, self.hc, self.dr, self.dc) < 1
            or self.hr * self.hc != heads
            or self.dr * self.dc != dim
        ):
            raise ValueError(f"tiling {self.spec()} does not fit {heads} heads x {dim} dims")


def candidate_tilings(heads: int, dim: int) -> list[Tiling]:
    """Every tiling the paper's three rules allow: head grids x head shapes (O(log H x log D))."""
    return [Tiling(hr, hc, dr, dc) for hr, hc in _divisor_pairs(heads) for dr, dc in _divisor_pairs(dim)]


@dataclass(frozen=True)
class FrameLayout:
    """Where every code of a ``tokens``-token chunk lands; all sizes derive from the fields."""

    heads: int
    dim: int
    tokens: int
    tiling: Tiling
    tokens_per_frame: int  # 0 = all tokens on one frame
    grid_cols: int = 0  # 0 = near-square frames
    min_side: int = NVENC_MIN_SIDE

    def __post_init__(self) -> None:
        self.tiling.check(self.heads, self.dim)
        if self.tokens < 1 or self.tokens_per_frame < 0 or self.grid_cols < 0 or self.min_side < 0:
            raise ValueError(f"bad frame layout {self}")

    @property
    def frames(self) -> int:
        """F: number of frames (= tokens per token group)."""
        n = self.tokens_per_frame or self.tokens
        return max(1, math.ceil(self.tokens / n))

    @property
    def slots(self) -> int:
        """G: token groups = block positions used on each frame."""
        return math.ceil(self.tokens / self.frames)

    @property
    def grid(self) -> tuple[int, int]:
        bh, bw = self.tiling.block
        g = self.slots
        cols = self.grid_cols or max(1, min(g, round(math.sqrt(g * bh / bw))))
        return math.ceil(g / cols), cols

    @property
    def content(self) -> tuple[int, int]:
        (gr, gc), (bh, bw) = self.grid, self.tiling.block
        return gr * bh, gc * bw

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the coded frame after padding."""
        ch, cw = self.content
        return _pad_side(ch, self.min_side), _pad_side(cw, self.min_side)

    def frame_tokens(self, f: int) -> np.ndarray:
        """Token indices on frame ``f``, in grid order (``f, f + F, f + 2F, ...``)."""
        return np.arange(f, self.tokens, self.frames)

    def describe(self) -> dict:
        h, w = self.size
        return {
            "tiling": self.tiling.spec(),
            "tokens_per_frame": self.tokens_per_frame,
            "frames": self.frames,
            "height": h,
            "width": w,
            "content": list(self.content),
        }


def _pad_side(n: int, min_side: int) -> int:
    return max(min_side, X265_MIN_SIDE, -(-n // ALIGN) * ALIGN)


def to_frames(lay: FrameLayout, codes: np.ndarray) -> np.ndarray:
    """Codes of one layer ``[T, H * D]`` uint8 -> padded plane stack ``[F, height, width]``."""
    t, c = codes.shape
    if t != lay.tokens or c != lay.heads * lay.dim:
        raise ValueError(f"codes {codes.shape} do not fit {lay}")
    f_n, g_n = lay.frames, lay.slots
    (gr, gc), ti = lay.grid, lay.tiling
    # pad tokens to G*F (repeat the last token), then token groups to gr*gc grid cells (repeat last cell)
    idx = np.minimum(np.arange(g_n * f_n), t - 1).reshape(g_n, f_n)
    idx = np.concatenate([idx, np.repeat(idx[-1:], gr * gc - g_n, axis=0)])
    blocks = codes[idx.T]  # [F, gr*gc, H*D]
    blocks = blocks.reshape(f_n, gr, gc, ti.hr, ti.hc, ti.dr, ti.dc)
    img = blocks.transpose(0, 1, 3, 5, 2, 4, 6).reshape(f_n, gr * ti.hr * ti.dr, gc * ti.hc * ti.dc)
    h, w = lay.size
    out = np.full((f_n, h, w), PAD_VALUE, np.uint8)  # constant padding: identical on every frame -> skipped
    out[:, : img.shape[1], : img.shape[2]] = img
    return out


def from_frame(lay: FrameLayout, plane: np.ndarray, f: int) -> np.ndarray:
    """One decoded plane ``[height, width]`` of frame ``f`` -> codes ``[n_f, H * D]`` of
    ``lay.frame_tokens(f)`` (a new contiguous array)."""
    (gr, gc), ti = lay.grid, lay.tiling
    ch, cw = lay.content
    img = plane[:ch, :cw].reshape(gr, ti.hr, ti.dr, gc, ti.hc, ti.dc)
    cells = img.transpose(0, 3, 1, 4, 2, 5).reshape(gr * gc, lay.heads * lay.dim)
    n = len(lay.frame_tokens(f))
    return np.ascontiguousarray(cells[:n])


def group_planes(layer_codes: list[np.ndarray], lay: FrameLayout) -> np.ndarray:
    """Up to three layers' codes -> ``[F, 3, height, width]`` (missing planes are constant 0)."""
    if not 1 <= len(layer_codes) <= 3:
        raise ValueError("a video carries one to three layers")
    h, w = lay.size
    out = np.zeros((lay.frames, 3, h, w), np.uint8)
    for j, codes in enumerate(layer_codes):
        out[:, j] = to_frames(lay, codes)
    return out
