"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each prompt token's (t, h, w), as transformers'
`get_rope_index` lays them out. A text token's three are equal and count on from the last
token before it; an image's tokens are its grid of merged patches, (t, row, column) each offset
by the position where the image starts, and the text after an image counts on from that start
plus the larger of its rows and columns:

    tokens   a  b  [i00 i01 i10 i11 i20 i21]  c     (an image of 3 x 2 merged patches)
    t        0  1    2   2   2   2   2   2    5
    h        0  1    2   2   3   3   4   4    5
    w        0  1    2   3   2   3   2   3    5

A video's (Qwen2.5-VL's) t is its patch in time times its time_interval, truncated as
transformers' float32 product is; the text after it counts on from max(rows, columns) too.

A token past the prompt (decode, or an output token recomputed) at position p turns by
p + delta in all three, delta = (the prompt's largest position + 1) - its length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ember.multimodal.inputs import ImageFeature


def mrope_positions(num_tokens: int, features: Sequence[ImageFeature], merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """([3, num_tokens] int64 positions of the prompt, delta) for a prompt whose images are
    `features` (each with its grid_thw in patches, merged merge_size x merge_size into tokens)."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cursor = current = 0
    for f in sorted(features, key=lambda f: f.offset):
        text = f.offset - cursor
        pos[:, cursor:f.offset] = np.arange(current, current + text)
        current += text
        t, h, w = f.grid_thw[0], f.grid_thw[1] // merge_size, f.grid_thw[2] // merge_size
        if t * h * w != f.length:
            raise ValueError(f"an image of grid {f.grid_thw} (merged {merge_size} x {merge_size}) has {t * h * w} "
                             f"tokens, its placeholder run {f.length}")
        times = (np.arange(t, dtype=np.float32) * np.float32(f.time_interval)).astype(np.int64)
        grid = np.stack(np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        pos[:, f.offset:f.end] = grid + current
        current += max(h, w)
        cursor = f.end
    pos[:, cursor:] = np.arange(current, current + num_tokens - cursor)
    return pos, int(pos.max(initial=-1)) + 1 - num_tokens
