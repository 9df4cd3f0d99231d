"""SpeculativeConfig: vLLM's `--speculative-config` / `LLM(speculative_config=...)` JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ember.models.config import ModelConfig

if TYPE_CHECKING:
    from ember.models.eagle3 import Eagle3Config

METHODS = ("ngram", "draft_model", "eagle3")
NOT_YET = {"eagle": "EAGLE-1 heads (EAGLE-3 heads: method 'eagle3')",
           "medusa": "Medusa heads", "mlp_speculator": "MLP speculators", "suffix": "suffix decoding",
           "mtp": "multi-token-prediction layers", "deepseek_mtp": "multi-token-prediction layers"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0  # K: drafts a request gets a step (required)
    # ngram: the longest and shortest suffix of the context looked up in its earlier tokens
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # no drafts in a step whose running requests are more than this (None: always draft)
    disable_by_batch_size: int | None = None
    # draft_model: a smaller model of the target's vocabulary; eagle3: an EAGLE-3 head (a path, as --model takes)
    model: str | None = None
    # filled by EngineConfig.resolve(): the draft model's config and weight format, the EAGLE-3 head's config
    draft_model_config: ModelConfig | None = field(default=None, compare=False)
    draft_quantization: str = field(default="none", compare=False)
    eagle3_config: Eagle3Config | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config: method {self.method!r} ({NOT_YET[self.method]}) is not supported "
                             f"yet; ember speculates with: {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r} (ember's: {', '.join(METHODS)})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs \"model\": the draft model's path")
        if self.method == "eagle3" and not self.model:
            raise ValueError("speculative_config: method 'eagle3' needs \"model\": the EAGLE-3 head's path (a "
                             "directory or hub id of a head trained for this target)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no model (drafts come from the request's own "
                             "tokens): leave \"model\" out, or use method 'draft_model'")
        if not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool) \
                or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer >= 1 (the drafts a "
                             f"request gets a step); got {self.num_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi),
                            ("disable_by_batch_size", self.disable_by_batch_size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"speculative_config: {name} must be an integer >= 1; got {value!r}")
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both
        lo, hi = (lo or hi or 5), (hi or lo or 5)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is more than prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def lookahead_slots(self) -> int:
        """KV slots past a request's computed tokens its drafter writes before the step that
        verifies the drafts: a draft model's K positions, an EAGLE-3 head's K - 1 (its first
        draft comes from the target's last row), none for prompt lookup."""
        return {"draft_model": self.num_speculative_tokens, "eagle3": self.num_speculative_tokens - 1}.get(self.method, 0)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From a JSON object (the command line's), a dict, or a SpeculativeConfig."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("speculative_config must be a JSON object such as "
                                 "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; got "
                                 f"{value!r:.80}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {value!r:.80}")
        if value.get("method") in NOT_YET:
            cls(method=value["method"], num_speculative_tokens=1)  # refused by name
        if value.get("method") is None and value.get("model") is not None:  # vLLM: a model alone is a draft model
            value = value | {"method": "draft_model"}
        known = {f.name for f in fields(cls) if f.name not in ("draft_model_config", "draft_quantization",
                                                               "eagle3_config")}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: key {unknown[0]!r} is not supported (ember's keys: "
                             f"{', '.join(sorted(known))})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required (the drafts a request gets a "
                             "step, e.g. 4)")
        return cls(**value)
