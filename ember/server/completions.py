"""POST /v1/completions: one engine request per prompt (n samples each), streamed or not,
with echo and prompt logprobs (scoring.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember.engine.async_engine import RequestStream
from ember.engine.beam_search import beam_search_output
from ember.outputs import RequestOutput
from ember.request import Request as EngineRequest
from ember.sampling_params import BeamSearchParams, SamplingParams
from ember.server import protocol as p
from ember.server import scoring
from ember.server.serving import (
    STREAMED_ERRORS,
    ServerState,
    all_samples,
    choice_finish_reason,
    engine_prompt,
    final_outputs,
    merge,
    prepare,
    submit,
    until_disconnected,
    usage_info,
)
from ember.server.streaming import Sent, completion_logprobs, new_logprobs, new_text, new_token_ids, sse, sse_data


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    limits = state.config.limits

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=STREAMED_ERRORS)
    async def completions(body: p.CompletionRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        request_id = f"cmpl-{body.engine_request_id or uuid.uuid4().hex}"
        as_ids = (state.config.return_tokens_as_token_ids if body.return_tokens_as_token_ids is None
                  else body.return_tokens_as_token_ids)

        def make() -> tuple[SamplingParams, list[EngineRequest]]:
            params = body.to_sampling_params(limits, engine.config.sampling_defaults)
            if body.echo:
                engine.inputs.require_tokenizer()  # to write token-id prompts back as text
            prompts = [engine_prompt(engine, prompt, body.add_special_tokens, body.truncate_prompt_tokens,
                                     body.cache_salt)
                       for prompt in body.prompts(limits)]
            return params, [engine.inputs.make_request(f"{request_id}-{i}", prompt, params, body.priority)
                            for i, prompt in enumerate(prompts)]

        beams = await prepare(engine, body.beam_search_params)
        if beams is not None:
            return JSONResponse(await beam_completion(engine, body, beams, request_id, model, raw, limits))
        params, requests = await prepare(engine, make)
        streams = submit(engine, requests)
        if body.stream:
            usage = body.include_usage or state.config.force_include_usage
            return sse(completion_chunks(streams, request_id, model, params, usage, as_ids, body.continuous_usage,
                                         body.return_token_ids), streams)
        finals = await until_disconnected(raw, final_outputs(streams), streams)
        ids = body.return_token_ids
        choices = [p.CompletionChoice(index=i * params.n + c.index, text=c.text,
                                      logprobs=completion_logprobs(c.logprobs, params, 0, as_ids)
                                      if c.logprobs is not None else None,
                                      finish_reason=choice_finish_reason(c), stop_reason=c.stop_reason,
                                      prompt_logprobs=scoring.prompt_logprobs(final, body.prompt_logprobs),
                                      prompt_token_ids=list(final.prompt_token_ids) if ids else None,
                                      token_ids=list(c.token_ids) if ids else None)
                   for i, final in enumerate(finals) for c in all_samples(final, params)]
        if body.echo:
            for choice in choices:
                scoring.echo(choice, finals[choice.index // params.n], body.logprobs, engine.inputs.tokenizer,
                             as_ids)
        response = p.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_info(finals))
        return JSONResponse(response.model_dump())


async def beam_completion(engine, body: p.CompletionRequest, params: BeamSearchParams, request_id: str, model: str,
                          raw: Request, limits) -> dict:
    """use_beam_search: each prompt's n best sequences (engine/beam_search.py; its beams run in
    the engine: engine/beam_groups.py); choices best first per prompt."""
    step = params.step_params()

    def make() -> list[EngineRequest]:
        return [engine.inputs.make_request(f"{request_id}-{i}", engine_prompt(engine, prompt, body.add_special_tokens),
                                           step, body.priority, beam=params) for i, prompt in enumerate(body.prompts(limits))]

    requests = await prepare(engine, make)
    streams = submit(engine, requests)
    finals = await until_disconnected(raw, final_outputs(streams), streams)
    tokenizer = engine.inputs.tokenizer
    decode = (lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)) if tokenizer is not None else None
    choices, generated = [], 0
    for i, final in enumerate(finals):
        for j, seq in enumerate(beam_search_output(final, params, decode).sequences):
            tokens = seq.tokens[len(final.prompt_token_ids):]
            generated += len(tokens)
            choices.append(p.CompletionChoice(index=i * params.beam_width + j, text=seq.text or "",
                                              finish_reason=seq.finish_reason,
                                              token_ids=tokens if body.return_token_ids else None))
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    usage = p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=generated,
                        total_tokens=prompt_tokens + generated)
    return p.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage).model_dump()


async def completion_chunks(streams: list[RequestStream], request_id: str, model: str, params: SamplingParams,
                             include_usage: bool, as_ids: bool = False, continuous_usage: bool = False,
                             token_ids: bool = False) -> AsyncIterator[str]:
    """`continuous_usage`: every chunk carries the usage so far; `token_ids`: a prompt's token
    ids in its first chunk, and each choice's new ones in its chunks (return_token_ids)."""
    created = int(time.time())

    def chunk(choices: list[p.CompletionChoice], usage: p.UsageInfo | None = None) -> str:
        return sse_data(p.CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                          usage=usage))

    sent = [[Sent() for _ in range(params.n)] for _ in streams]
    last: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        first = last[i] is None
        last[i] = out
        for c in out.outputs:
            s = sent[i][c.index]
            if s.done:
                continue
            offset = s.text
            text, logprobs = new_text(c, s, params), new_logprobs(c, s)
            ids = new_token_ids(c, s) if token_ids else None
            s.done = c.finished
            if text or logprobs or s.done or ids:
                yield chunk([p.CompletionChoice(
                    index=i * params.n + c.index, text=text,
                    logprobs=completion_logprobs(logprobs, params, offset, as_ids) if logprobs is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason, token_ids=ids,
                    prompt_token_ids=list(out.prompt_token_ids) if token_ids and first else None)],
                    usage_info([o for o in last if o is not None]) if continuous_usage else None)
                first = False
    for i, per_prompt in enumerate(sent):
        for j, s in enumerate(per_prompt):
            if not s.done:
                yield chunk([p.CompletionChoice(index=i * params.n + j, text="", finish_reason="abort")])
    if include_usage:
        yield chunk([], usage_info([o for o in last if o is not None]))
    yield "data: [DONE]\n\n"
