"""Turns the core's new tokens into RequestOutputs: incremental text, stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine.core import EngineCoreOutput
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.loader.tokenizer import Tokenizer
from ember.outputs import CompletionOutput, RequestOutput
from ember.request import Request


@dataclass
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    stop_reason: str | None = None  # set when a stop string ended the request


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.sampling_params.skip_special_tokens,
                                           request.prompt_token_ids)
        self.states[request.request_id] = _RequestState(request, detok)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the requests' outputs and the (request id, stop string) pairs that the
        engine must now finish."""
        results, stopped = [], []
        for out in outputs:
            state = self.states[out.request.request_id]
            if state.detokenizer is not None and state.stop_reason is None:
                searched = len(state.text)
                state.text += state.detokenizer.add(out.new_token_ids)
                if out.finished:
                    state.text += state.detokenizer.flush()  # a tail that ends mid-character
                if not out.finished and self._check_stop_strings(state, searched):
                    stopped.append((out.request.request_id, state.stop_reason))
            results.append(self._make_output(state, finished=out.finished or state.stop_reason is not None))
        return results, stopped

    def _check_stop_strings(self, state: _RequestState, searched: int) -> bool:
        """Look for a stop string that ends in the new text (the first `searched` chars held none)."""
        params = state.request.sampling_params
        if not params.stop or len(state.request.output_token_ids) < params.min_tokens:
            return False
        for stop in params.stop:
            at = state.text.find(stop, max(0, searched - len(stop) + 1))
            if at != -1:
                state.text = state.text[: at + len(stop) if params.include_stop_str_in_output else at]
                state.stop_reason = stop
                return True
        return False

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        req = state.request
        reason = "stop" if state.stop_reason is not None else req.finish_reason
        completion = CompletionOutput(
            index=0, text=state.text, token_ids=list(req.output_token_ids),
            finish_reason=reason if finished else None,
            stop_reason=state.stop_reason if state.stop_reason is not None else req.stop_reason,
        )
        if finished:
            del self.states[req.request_id]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
