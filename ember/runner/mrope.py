"""MRopePositions: the positions a step's rows turn by in a model with M-RoPE (Qwen2-VL and its family),
each request's computed once from its images (multimodal/mrope.py) and kept until it leaves.

A row within the prompt takes its (t, h, w) from the request's table, so chunked prefill and a
prefix-cache hit start wherever they start; a row past the prompt (decode, recompute) takes
p + delta. Only an image's tokens have t, h and w apart, and a chunk over them has image
embeddings, so runs eager: every other step keeps 1-D positions (its rows' common value), and
the decode and piecewise CUDA graphs their [N] positions buffer.
"""

from __future__ import annotations

import numpy as np

from ember.multimodal.mrope import mrope_positions
from ember.request import Request


class MRopePositions:
    def __init__(self, merge_size: int) -> None:
        self.merge_size = merge_size
        # request id -> (its prompt's [3, P] positions, None for a prompt without images; delta)
        self.requests: dict[str, tuple[np.ndarray | None, int]] = {}

    def _entry(self, req: Request) -> tuple[np.ndarray | None, int]:
        entry = self.requests.get(req.request_id)
        if entry is None:
            entry = mrope_positions(req.num_prompt_tokens, req.mm_features, self.merge_size) \
                if req.mm_features else (None, 0)
            self.requests[req.request_id] = entry
        return entry

    def delta(self, req: Request) -> int:
        """What a row past the prompt adds to its position (0 for a prompt without images)."""
        return self._entry(req)[1]

    def chunk(self, req: Request, start: int, end: int) -> tuple[range | list[int], np.ndarray | None]:
        """Rows start..end of the request: (their 1-D positions, [3, n] positions where t, h and w
        differ in some row, else None)."""
        table, delta = self._entry(req)
        if table is None or start >= table.shape[1]:
            return range(start + delta, end + delta), None
        within = table[:, start:min(end, table.shape[1])]
        past = range(table.shape[1] + delta, end + delta) if end > table.shape[1] else range(0)
        flat = within[0].tolist() + list(past)
        if (within[0] == within[1]).all() and (within[0] == within[2]).all():
            return flat, None
        return flat, np.concatenate([within, np.tile(np.asarray(past, dtype=np.int64), (3, 1))], axis=1)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
