"""PoolerConfig: how a pooling engine (runner="pooling") turns a prompt's final hidden
states (after the final norm, before the LM head) into one vector, as vLLM's
`--pooler-config '{"pooling_type": "MEAN", "normalize": false}'` does.

A decoder LM run as an embedding model pools its last token by default (vLLM's default for
*ForCausalLM converted to embedding), L2-normalized."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ember.sampling_params import SamplingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"  # LAST: the last prompt token; MEAN: the average of all; CLS: the first
    normalize: bool = True  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false; got {self.normalize!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | PoolerConfig) -> PoolerConfig:
        """From a JSON object (vLLM's --pooler-config), a dict, or a PoolerConfig; the
        pooling type in any case."""
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"pooler_config must be a JSON object such as "
                                 f"'{{\"pooling_type\": \"MEAN\"}}'; got {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object; got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if isinstance(value.get("pooling_type"), str):
            value = value | {"pooling_type": value["pooling_type"].upper()}
        return cls(**value)


def pooling_sampling_params() -> SamplingParams:
    """What a pooling request carries: it computes its prompt and ends without sampling
    (max_tokens=1 tells the scheduler that no step follows its last prompt chunk)."""
    return SamplingParams(temperature=0, max_tokens=1)


def label_probs(logits: Sequence[float]) -> list[float]:
    """A classification head's logits as probabilities: softmax over the labels, or the
    sigmoid of a single one (vLLM's default activation, and sentence-transformers' CrossEncoder's)."""
    if len(logits) == 1:
        return [1 / (1 + math.exp(-logits[0]))]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def score_pairs(first: str | Sequence[str], second: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing for scores: one first text against each second, or first[i] against
    second[i]; ValueError for empty or unequal lists."""
    one = [first] if isinstance(first, str) else list(first)
    two = [second] if isinstance(second, str) else list(second)
    if not one or not two:
        raise ValueError("text_1 and text_2 must each be a string or a non-empty list")
    if len(one) == 1:
        return [(one[0], t) for t in two]
    if len(one) != len(two):
        raise ValueError(f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or as many as text_2")
    return list(zip(one, two))
