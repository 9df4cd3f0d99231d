"""Batched sampling with per-request parameters."""

from __future__ import annotations

import torch

from ember.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator: torch.Generator | None = None
        self.seed = seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits: [num_rows, vocab] float32, one row per sampled request."""
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        if self.generator is None or self.generator.device != logits.device:
            self.generator = torch.Generator(device=logits.device).manual_seed(self.seed)
        out = greedy.tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                probs = _probs(logits[i], p)
                out[i] = int(torch.multinomial(probs, 1, generator=generators[i] or self.generator))
        return out


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return probs
