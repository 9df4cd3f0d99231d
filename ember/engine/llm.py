"""The offline API: `LLM(...).generate(prompts)` and `.chat(conversations)`, vLLM's shape."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ember.config import EngineConfig
from ember.engine.beam_search import BeamSearchOutput, beam_search_output
from ember.engine.core_client import ABORT, ADD, InprocCoreClient, MPCoreClient, send_text_verdicts
from ember.engine.input_processor import Conversation, InputProcessor, PromptType, load_engine_tokenizer
from ember.engine.output_processor import OutputProcessor
from ember.loader.tokenizer import Tokenizer
from ember.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ember.pooling import cosine, label_probs, pooling_sampling_params, score_pairs
from ember.request import Request
from ember.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["LLM", "PromptType", "Conversation"]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", load_format: str = "auto",
                 core_process: bool = False, **engine_args: Any) -> None:
        """`model`: a .gguf file, an HF directory or a Hugging Face Hub id; `core_process`: run
        the engine core in its own process (detokenizing then overlaps the steps); `engine_args`:
        the other EngineConfig fields (revision, download_dir, tokenizer, chat_template,
        generation_config, max_model_len, ...)."""
        self.config = EngineConfig(model=model, dtype=dtype, load_format=load_format, **engine_args).resolve()
        self.tokenizer: Tokenizer | None = load_engine_tokenizer(self.config)
        self.client = (MPCoreClient if core_process else InprocCoreClient)(self.config, self.tokenizer)
        self.engine = getattr(self.client, "core", None)  # the EngineCore, when it runs in this process
        self.config = self.client.config  # the seats the KV pool allows, where max_num_seqs was the default
        self.inputs = InputProcessor(self.config, self.tokenizer, self.client.check_request)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # -- public API -----------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order."""
        self._require_runner("generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts: pass one per prompt")
        requests = [self._make_request(p, sp, priority[i] if priority is not None else 0)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        return self._run(requests, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best sequences by transformers' beam search
        (engine/beam_search.py), in input order; every search's beams run in the engine at once
        (engine/beam_groups.py)."""
        self._require_runner("generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        requests = [self.inputs.make_request(str(next(self._ids)), p, params.step_params(), beam=params)
                    for p in prompts]
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return [beam_search_output(out, params, decode) for out in self._run(requests, use_tqdm)]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Render each conversation with the chat template and complete it. `tools`: function
        definitions in OpenAI's shape ({"type": "function", "function": {"name", ...}}) for
        templates that offer tools; read the calls out of an output with a parser
        (`ember.parsers.get_tool_parser`). `mm_processor_kwargs`: vLLM's, of which ember takes
        {"do_pan_and_scan": bool} (Gemma 3) alone. `template_kwargs` reach the template too."""
        if not messages:
            raise ValueError("messages is empty: pass a list of {'role', 'content'} dicts")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError('tools must be a list of {"type": "function", "function": {...}} dicts')
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.inputs.chat_prompt(conv, add_generation_prompt, tools=tools,
                                           mm_processor_kwargs=mm_processor_kwargs, **template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled final hidden state (runner="pooling"; see PoolerConfig), in input order."""
        self._require_classifier(False, "LLM.embed")
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids)
                for out in self._pool(prompts, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 use_tqdm: bool = False) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities from a sequence-classification model (softmax
        over its labels, the sigmoid of one), in input order; the names are
        `config.model_config.label_names`."""
        self._require_classifier(True, "LLM.classify")
        return [ClassificationRequestOutput(out.request_id, ClassificationOutput(label_probs(out.embedding)),
                                            out.prompt_token_ids) for out in self._pool(prompts, use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """How well each pair matches (one text_1 against each text_2, or pairwise): a
        cross-encoder's (one-label classification model's) probability for the pair read
        together, else the cosine similarity of the two texts' embeddings."""
        self._require_runner("pooling")
        pairs = score_pairs(text_1, text_2)
        mc = self.config.model_config
        if mc.classifier is not None:
            if mc.num_labels != 1:
                raise ValueError(f"LLM.score needs a cross-encoder of one label; this model has {mc.num_labels} "
                                 "(use LLM.classify)")
            outs = self._pool([self.inputs.pair_prompt(a, b) for a, b in pairs], use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(label_probs(o.embedding)[0]), o.prompt_token_ids)
                    for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors = dict(zip(texts, self._pool(texts, use_tqdm)))
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(cosine(vectors[a].embedding, vectors[b].embedding)),
                                     vectors[a].prompt_token_ids + vectors[b].prompt_token_ids)
                for i, (a, b) in enumerate(pairs)]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One prompt's output after every step that changed it, the last one finished."""
        self._require_runner("generate")
        yield from self._drive([self._make_request(prompt, sampling_params or self.get_default_sampling_params())])

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without SamplingParams gets: SamplingParams' defaults, with the
        sampling fields the model's generation_config.json sets (unless generation_config='vllm')."""
        return SamplingParams(**self.config.sampling_defaults)

    def check_idle(self) -> None:
        """Assert that no request left anything behind (tests call it between requests)."""
        self.engine.check_idle()
        assert not self.processor.groups, "the output processor still tracks requests"

    def shutdown(self) -> None:
        """Stop the core's process and the tensor-parallel workers, if any (they also stop
        when this process ends)."""
        self.client.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.inputs.require_tokenizer()

    # -- internals ------------------------------------------------------------------------

    def _pool(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool) -> list[RequestOutput]:
        """Each prompt's pooled vector (a classification model's: its logits), in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        outputs = self._run([self._make_request(p, pooling_sampling_params()) for p in prompts], use_tqdm)
        for out in outputs:
            if out.embedding is None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return outputs

    def _require_classifier(self, wanted: bool, what: str) -> None:
        self._require_runner("pooling")
        if (self.config.model_config.classifier is not None) != wanted:
            kind = "a sequence-classification model" if wanted else "an embedding model"
            use = "LLM.embed or LLM.score" if wanted else "LLM.classify or LLM.score"
            raise ValueError(f"{what} needs {kind}; {self.config.model} is not one: use {use}")

    def _require_runner(self, runner: str) -> None:
        if self.config.runner != runner:
            what = "LLM.embed" if runner == "pooling" else "LLM.generate, chat and stream"
            raise ValueError(f"{what} needs an LLM made with runner={runner!r}; this one has "
                             f"runner={self.config.runner!r}")

    def _run(self, requests: list[Request], use_tqdm: bool = False) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(requests)) if use_tqdm else None
        for out in self._drive(requests, finished_only=bar is None):
            if bar is not None:
                bar.update(out)
            if out.finished:
                finished[out.request_id] = out
        if bar is not None:
            bar.close()
        return [finished[r.request_id] for r in requests]

    def _drive(self, requests: list[Request], finished_only: bool = False) -> Iterator[RequestOutput]:
        """Run the engine until these requests finish, yielding every output on the way (or
        only the finished ones)."""
        pending: set[str] = set()
        try:
            for req in requests:
                self.processor.add_request(req)
                pending.add(req.request_id)
                self.client.send((ADD, req))
            while pending:
                step = self.client.get_step()
                if step is None:
                    continue
                done = self.processor.process(step.outputs, finished_only)
                send_text_verdicts(self.client, done)
                for out in done.outputs:
                    if out.finished:
                        pending.discard(out.request_id)
                yield from done.outputs
        finally:  # an error or Ctrl-C leaves nothing behind in the engine
            for request_id in pending:
                self.client.send((ABORT, request_id))
                self.processor.abort(request_id)
            if not self.processor.groups:  # no other stream is served: a step still in flight was ours
                self.client.settle()

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts: pass one, or one per prompt")
        return sampling_params

    def _make_request(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> Request:
        return self.inputs.make_request(str(next(self._ids)), prompt, params, priority)


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
