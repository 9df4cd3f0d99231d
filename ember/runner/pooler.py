"""Pooler: a prompt's final hidden states become one vector (runner="pooling").

A prompt may be computed over several steps (chunked prefill): each chunk's rows add to a
running float32 state kept per request (the sum for MEAN, the first row for CLS), and the
chunk that ends the prompt gives the pooled vector (LAST: its last row). A chunk that
starts at position 0 starts the state afresh, so a preempted request that recomputes its
prompt pools it once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.pooling import PoolerConfig
from ember.scheduler.scheduler import SchedulerOutput


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self.partial: dict[str, torch.Tensor] = {}  # request id -> its state after the chunks so far

    def pool(self, hidden: torch.Tensor, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Request id -> its pooled float32 vector, for the chunks of `plan` that end their
        prompt; `hidden` holds the step's rows in the plan's order."""
        kind = self.config.pooling_type
        pooled = {}
        row = 0
        for chunk in plan.chunks:
            request_id, rows = chunk.request.request_id, hidden[row:row + chunk.num_new_tokens]
            row += chunk.num_new_tokens
            first = chunk.start == 0
            if kind == "MEAN":
                state = rows.float().sum(0) + (0 if first else self.partial[request_id])
            elif kind == "CLS":
                state = rows[0].float() if first else self.partial[request_id]
            else:
                state = rows[-1].float()
            if not chunk.samples:  # the prompt goes on in a later step
                self.partial[request_id] = state
                continue
            self.partial.pop(request_id, None)
            if kind == "MEAN":
                state = state / (chunk.start + chunk.num_new_tokens)
            pooled[request_id] = F.normalize(state, dim=-1) if self.config.normalize else state
        return pooled

    def release(self, request_id: str) -> None:
        self.partial.pop(request_id, None)
