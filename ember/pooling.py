"""PoolerConfig: how a pooling engine (runner="pooling") turns a prompt's final hidden
states (after the final norm, before the LM head) into one vector, as vLLM's
`--pooler-config '{"pooling_type": "MEAN", "normalize": false}'` does.

A decoder LM run as an embedding model pools its last token by default (vLLM's default for
*ForCausalLM converted to embedding), L2-normalized."""

from __future__ import annotations

import json
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
