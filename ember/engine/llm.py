"""The offline API: `LLM(...).generate(prompts)` and `.chat(conversations)`, vLLM's shape."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import Any, Union

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.output_processor import OutputProcessor
from ember.loader.tokenizer import Tokenizer, load_tokenizer
from ember.outputs import RequestOutput
from ember.request import Request
from ember.sampling_params import SamplingParams
from ember.scheduler.scheduler import check_prompt_length

logger = logging.getLogger(__name__)

PromptType = Union[str, dict[str, Any]]  # "text" or {"prompt_token_ids": [...]}
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", load_format: str = "auto",
                 **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, load_format=load_format, **engine_args).resolve()
        self.tokenizer: Tokenizer | None = self._load_tokenizer()
        self.engine = EngineCore(self.config)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _load_tokenizer(self) -> Tokenizer | None:
        path = Path(self.config.model)
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            logger.warning("%s has no tokenizer.json: ember takes {'prompt_token_ids': [...]} prompts only", path)
            return None
        return load_tokenizer(path)

    # -- public API -----------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts: pass one per prompt")
        requests = [self._make_request(p, sp, priority[i] if priority is not None else 0)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        return self._run(requests, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             **template_kwargs: Any) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages is empty: pass a list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self._require_tokenizer()
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One prompt's output after every step that changed it, the last one finished."""
        yield from self._drive([self._make_request(prompt, sampling_params or SamplingParams())])

    def get_tokenizer(self) -> Tokenizer:
        return self._require_tokenizer()

    # -- internals ------------------------------------------------------------------------

    def _run(self, requests: list[Request], use_tqdm: bool = False) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(requests)) if use_tqdm else None
        for out in self._drive(requests):
            if bar is not None:
                bar.update(out)
            if out.finished:
                finished[out.request_id] = out
        if bar is not None:
            bar.close()
        return [finished[r.request_id] for r in requests]

    def _drive(self, requests: list[Request]) -> Iterator[RequestOutput]:
        """Run the engine until these requests finish, yielding every output on the way."""
        added = []
        try:
            for req in requests:
                self.engine.add_request(req)
                self.processor.add_request(req)
                added.append(req.request_id)
            while self.engine.has_unfinished_requests():
                outputs, stopped = self.processor.process(self.engine.step())
                for request_id, stop in stopped:
                    self.engine.finish_request(request_id, stop)
                yield from outputs
        finally:  # an error or Ctrl-C leaves nothing behind in the engine
            for request_id in added:
                self.engine.abort_request(request_id)
                self.processor.abort(request_id)

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts: pass one, or one per prompt")
        return sampling_params

    def _make_request(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> Request:
        if isinstance(prompt, str):
            text, ids = prompt, self._require_tokenizer().encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self._require_tokenizer().encode(prompt["prompt"])
        else:
            raise ValueError(f"a prompt is a str or {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")
        self._check_prompt(ids)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        if not eos and self.config.model_config.eos_token_id is not None:
            eos = frozenset([self.config.model_config.eos_token_id])
        if params.logit_bias and any(not 0 <= int(t) < self.config.model_config.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {self.config.model_config.vocab_size})")
        return Request(str(next(self._ids)), ids, params, prompt=text, eos_token_ids=eos, priority=priority)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        check_prompt_length(len(ids), self.config.max_model_len)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer: pass {{'prompt_token_ids': [...]}} prompts")
        return self.tokenizer


class _ProgressBar:
    """tqdm over finished requests, with prompt and output tokens/s."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.seen: dict[str, int] = {}
        self.prompt_tokens = 0

    def update(self, out: RequestOutput) -> None:
        if out.request_id not in self.seen:
            self.prompt_tokens += len(out.prompt_token_ids)
        self.seen[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix_str(f"input: {self.prompt_tokens / elapsed:.1f} toks/s, "
                                 f"output: {sum(self.seen.values()) / elapsed:.1f} toks/s", refresh=False)
        if out.finished:
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
