"""How `select` picks among its choices from their tokens' logprobs (SGLang's methods and
their meta_info): token_length_normalized (the mean, the default), greedy_token (token by
token), unconditional_likelihood_normalized (the mean gain over the choice read alone) and
token_logprob_sum (the plain sum). Each choice's logprobs are of its own tokens only, as
(logprob, token id, token text or None) tuples."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

TokenLogprobs = list[tuple[float, int, Any]]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax_first(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether the choices are also scored alone, without the prompt."""
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[TokenLogprobs], output_token_logprobs: list[TokenLogprobs],
                 unconditional_token_logprobs: list[TokenLogprobs] | None = None) -> ChoicesDecision: ...

    @staticmethod
    def _meta(normalized: list[float], inputs: list[TokenLogprobs], outputs: list[TokenLogprobs],
              **more: Any) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs,
                "output_token_logprobs": outputs, **more}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice whose tokens' mean logprob is highest (the first on a tie)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], self._meta(normalized_prompt_logprobs, input_token_logprobs,
                                                         output_token_logprobs))


class TokenLogprobSum(ChoicesSamplingMethod):
    """The choice whose tokens' summed logprob (the sequence's likelihood) is highest."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        sums = [sum(t[0] for t in tokens) for tokens in input_token_logprobs]
        return ChoicesDecision(choices[_argmax_first(sums)], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs, prompt_logprob_sums=sums))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices whose logprob at this position is the highest, until
    one is left; a shorter choice continues at its own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(tokens) for tokens in input_token_logprobs)
        matrix = []
        for tokens in input_token_logprobs:
            row = [t[0] for t in tokens]
            mean = sum(row) / len(row) if row else float("nan")
            matrix.append(row + [mean] * (width - len(row)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs, greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most logprob on average from the prompt: each
    token's logprob minus its logprob in the choice read alone (the first of which has no
    context: 0)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the choices' unconditional logprobs")
        gains = []
        for inputs, alone in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(inputs) != len(alone):
                raise ValueError("a choice's conditional and unconditional logprobs differ in length")
            base = [t[0] or 0.0 for t in alone]
            gains.append(sum(t[0] - b for t, b in zip(inputs, base)) / len(inputs))
        return ChoicesDecision(choices[_argmax_first(gains)], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
            normalized_unconditional_prompt_logprobs=gains))


token_length_normalized = TokenLengthNormalized()
token_logprob_sum = TokenLogprobSum()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
