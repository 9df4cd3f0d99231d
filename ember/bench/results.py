"""The benchmarks' plain records: a random request, and what one timed run measured (a leaf:
throughput.py, hf_baseline.py and serve.py share them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RandomRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class ThroughputResult:
    label: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    forced_tokens: int = 0  # structured output: appended by jump-forward, without a forward each

    def to_dict(self) -> dict[str, Any]:
        t = self.elapsed_s
        return asdict(self) | {
            "requests_per_s": self.num_requests / t,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / t,
            "output_tokens_per_s": self.output_tokens / t,
        }
