"""Turns the core's new tokens into RequestOutputs: incremental text, stop strings,
logprobs, and the n samples of a request gathered into one output.

Each request's work here runs on its own: if its text or logprobs raise, that request
ends with finish_reason "error" (listed in `ProcessedOutputs.failed` for the engine to
end it in the core too), and the others go on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ember.engine.core import EngineCoreOutput
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.loader.tokenizer import Tokenizer
from ember.outputs import CompletionOutput, Logprob, RequestOutput
from ember.request import Request
from ember.runner.sampler import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """One of a request's n completions, as far as the core's outputs told."""

    request: Request  # the request as added (all its samples share prompt and parameters)
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Group:
    request: Request  # the request as added (sample 0)
    samples: dict[int, _Sample] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # a sample failed: the request ends with this message
    embedding: list[float] | None = None  # runner="pooling"
    num_cached_tokens: int = 0

    @property
    def num_samples(self) -> int:
        """Its n; a beam search's beam_width (its hypotheses)."""
        return self.request.beam.beam_width if self.request.beam is not None else self.request.sampling_params.n

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        if len(self.samples) != self.num_samples:
            return False
        for s in self.samples.values():  # a loop, not all(): this runs for every request every step
            if s.finish_reason is None:
                return False
        return True


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]  # of the requests that changed (or finished, with `finished_only`)
    stopped: list[tuple[str, str]]  # (request id, stop string): the engine must finish these
    failed: list[tuple[str, str]]  # (request id, message): their text failed here; the engine must fail them


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}

    def add_request(self, request: Request) -> None:
        group = _Group(request)
        if request.sampling_params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first prompt token has no context
        self.groups[request.request_id] = group

    def process(self, outputs: list[EngineCoreOutput], finished_only: bool = False) -> ProcessedOutputs:
        """The changed requests' outputs (with `finished_only`, those that finished: an
        offline batch skips copying every request's tokens every step), and the requests
        that a stop string ended or whose processing failed here."""
        touched: dict[str, _Group] = {}
        result = ProcessedOutputs([], [], [])
        for out in outputs:
            group = self.groups.get(out.parent_id if out.parent_id is not None else out.request_id)
            if group is None:
                continue  # its request ended already (a failed sample ended the group)
            touched[group.request.request_id] = group
            try:
                self._process_one(group, out, result)
            except Exception as e:
                logger.exception("request %s: its output could not be processed", out.request_id)
                group.error = f"its output could not be processed ({type(e).__name__})"
                sample = group.samples.get(out.index)
                if sample is not None:
                    sample.finish_reason = "error"
                result.failed.append((out.request_id, group.error))
        for g in touched.values():
            finished = g.finished
            if finished:
                del self.groups[g.request.request_id]
            if finished or not finished_only:
                result.outputs.append(self._make_output(g, finished))
        return result

    def _process_one(self, group: _Group, out: EngineCoreOutput, result: ProcessedOutputs) -> None:
        if out.num_cached_tokens is not None:
            group.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self._add_prompt_logprobs(group, out.prompt_logprobs.first_position, out.prompt_logprobs.tokens)
        if out.pooled is not None:
            group.embedding = out.pooled
        if not out.new_token_ids and not out.finished:
            return
        sample = group.samples.get(out.index) or self._new_sample(group, out.index)
        if sample.finish_reason is not None:
            return
        sample.token_ids += out.new_token_ids
        if out.logprobs is not None:
            self._add_logprobs(sample, out.logprobs)
        if out.cumulative_logprob is not None:  # a beam search's hypothesis: its score's sum alone
            sample.logprobs, sample.cumulative_logprob = None, out.cumulative_logprob
        if self._add_text(sample, out):
            result.stopped.append((out.request_id, sample.stop_reason))
        elif out.finished and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if out.error is not None:
                group.error = out.error

    def abort(self, request_id: str) -> None:
        self.groups.pop(request_id, None)

    def _new_sample(self, group: _Group, index: int) -> _Sample:
        req = group.request
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.sampling_params.skip_special_tokens,
                                           req.prompt_token_ids)
        sample = _Sample(req, detok)
        if req.sampling_params.logprobs is not None:
            sample.logprobs, sample.cumulative_logprob = [], 0.0
        group.samples[index] = sample
        return sample

    def _add_text(self, sample: _Sample, out: EngineCoreOutput) -> bool:
        """Append the new text; True when a stop string ended a still-running sample here. Several
        new tokens at once (accepted drafts, tokens a grammar forced) are searched one by one, so a
        stop string ends the sample at the token where it would have without them: the tokens
        after that one are dropped, with their logprobs."""
        if sample.detokenizer is None:
            return False
        req, params = sample.request, sample.request.sampling_params
        new_ids = out.new_token_ids
        if (out.finished and out.finish_reason == "stop" and not params.include_stop_str_in_output and new_ids
                and (new_ids[-1] in req.eos_token_ids or new_ids[-1] in params.stop_token_ids)):
            new_ids = new_ids[:-1]  # as vLLM: an EOS or stop token's own text is left out
        before = len(sample.token_ids) - len(out.new_token_ids)  # the sample's tokens before these
        pieces = [new_ids] if not params.stop or len(new_ids) < 2 else [[t] for t in new_ids]
        for i, ids in enumerate(pieces):
            searched = len(sample.text)
            sample.text += sample.detokenizer.add(ids)
            if out.finished and i == len(pieces) - 1:
                sample.text += sample.detokenizer.flush()  # a tail that ends mid-character
            kept = len(sample.token_ids) if len(pieces) == 1 else before + i + 1
            if params.stop and kept >= params.min_tokens and self._stop_string(sample, params, searched):
                self._drop_tokens_after(sample, kept)
                return not out.finished
        return False

    @staticmethod
    def _stop_string(sample: _Sample, params, searched: int) -> bool:
        """Whether a stop string ends in the text after `searched`: the text cut there, the sample stopped."""
        for stop in params.stop:  # only a stop string that ends in the new text
            at = sample.text.find(stop, max(0, searched - len(stop) + 1))
            if at != -1:
                sample.text = sample.text[: at + len(stop) if params.include_stop_str_in_output else at]
                sample.finish_reason, sample.stop_reason = "stop", stop
                return True
        return False

    @staticmethod
    def _drop_tokens_after(sample: _Sample, kept: int) -> None:
        if sample.logprobs is not None:
            for token, entry in zip(sample.token_ids[kept:], sample.logprobs[kept:]):
                sample.cumulative_logprob -= entry[token].logprob
            del sample.logprobs[kept:]
        del sample.token_ids[kept:]

    def _add_logprobs(self, sample: _Sample, tokens: list[TokenLogprobs]) -> None:
        for t in tokens:
            sample.logprobs.append(self._logprob_dict(t))
            sample.cumulative_logprob += t.logprob

    def _add_prompt_logprobs(self, group: _Group, first_position: int, tokens: list[TokenLogprobs]) -> None:
        # a preempted request recomputes its prompt: keep only positions not seen yet; a
        # prefix-cache hit before prompt_logprobs_start leaves its positions None
        group.prompt_logprobs.extend([None] * (first_position - len(group.prompt_logprobs)))
        for position, t in enumerate(tokens, start=first_position):
            if position == len(group.prompt_logprobs):
                group.prompt_logprobs.append(self._logprob_dict(t))

    def _logprob_dict(self, t: TokenLogprobs) -> dict[int, Logprob]:
        entries = {t.token_id: Logprob(t.logprob, t.rank, self._decode(t.token_id))}
        for rank, (tid, lp) in enumerate(zip(t.top_ids, t.top_logprobs), start=1):
            entries.setdefault(tid, Logprob(lp, rank, self._decode(tid)))
        return entries

    def _decode(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _make_output(self, group: _Group, finished: bool) -> RequestOutput:
        req = group.request
        completions = [
            CompletionOutput(index=i, text=s.text, token_ids=list(s.token_ids),
                             cumulative_logprob=s.cumulative_logprob,
                             logprobs=list(s.logprobs) if s.logprobs is not None else None,
                             finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for i, s in sorted(group.samples.items())
        ]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, finished,
                             prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs else None,
                             num_cached_tokens=group.num_cached_tokens, error=group.error,
                             embedding=group.embedding)
