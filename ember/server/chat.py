"""POST /v1/chat/completions and POST /v1/responses (run as the chat completion it
translates to, responses.py): the chat template, tools and reasoning (tool_calls.py),
streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember.engine.async_engine import AsyncEngine, RequestStream
from ember.outputs import RequestOutput
from ember.request import Request as EngineRequest
from ember.sampling_params import SamplingParams
from ember.server import protocol as p
from ember.server import scoring
from ember.server.responses import ResponseBuilder, ResponsesRequest
from ember.server.serving import (
    STREAMED_ERRORS,
    ServerConfig,
    ServerState,
    all_samples,
    final_outputs,
    prepare,
    submit,
    until_disconnected,
    usage_info,
)
from ember.server.streaming import Sent, chat_logprobs, new_logprobs, new_text, sse, sse_lines
from ember.server.tool_calls import ToolPlan, plan_tools


def add_chat_routes(app: FastAPI, state: ServerState) -> None:
    config = state.config

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=STREAMED_ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def make() -> tuple[SamplingParams, list[EngineRequest], ToolPlan]:
            return chat_requests(engine, config, body, request_id)

        params, requests, tools = await prepare(engine, make)
        streams = submit(engine, requests)
        if body.stream:
            usage = body.include_usage or config.force_include_usage
            chunks = chat_chunks(streams[0], request_id, model, params, usage, tools)
            return sse(sse_lines(chunks), streams)
        final = (await until_disconnected(raw, final_outputs(streams), streams))[0]
        return JSONResponse(chat_answer(final, params, tools, body, request_id, model).model_dump())

    @app.post("/v1/responses", responses=STREAMED_ERRORS)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API, run as the chat completion it translates to (responses.py)."""
        engine = state.ready_engine()
        model = state.check_model(body.model)
        answer = ResponseBuilder(body, model)

        def make() -> tuple[p.ChatCompletionRequest, SamplingParams, list[EngineRequest], ToolPlan]:
            chat = p.ChatCompletionRequest.model_validate(body.chat_request())
            return chat, *chat_requests(engine, config, chat, answer.id)

        chat, params, requests, tools = await prepare(engine, make)
        streams = submit(engine, requests)
        if body.stream:
            chunks = chat_chunks(streams[0], answer.id, model, params, True, tools)
            return sse(answer.events(chunk.model_dump() async for chunk in chunks), streams)
        final = (await until_disconnected(raw, final_outputs(streams), streams))[0]
        return JSONResponse(answer.from_chat(chat_answer(final, params, tools, chat, answer.id, model).model_dump()))


def chat_requests(engine: AsyncEngine, config: ServerConfig, body: p.ChatCompletionRequest,
                   request_id: str) -> tuple[SamplingParams, list[EngineRequest], ToolPlan]:
    """A chat request's sampling parameters, its engine request and its tool plan (on the
    input pool: the template and the tools' grammar grow with the input)."""
    tools = plan_tools(body, config.tool_call_parser, config.reasoning_parser)
    params = tools.sampling_params(body.to_sampling_params(config.limits, engine.config.sampling_defaults))
    prompt = engine.inputs.chat_prompt(body.conversation(), body.add_generation_prompt, tools=tools.tools,
                                       **(config.default_chat_template_kwargs | body.template_kwargs()))
    params, tools = tools.gate_reasoning(params, prompt["prompt"], engine.inputs.require_tokenizer())
    return params, [engine.inputs.make_request(request_id, prompt, params, body.priority)], tools


def chat_answer(final: RequestOutput, params: SamplingParams, tools: ToolPlan, body: p.ChatCompletionRequest,
                 request_id: str, model: str) -> p.ChatCompletionResponse:
    choices = []
    for c in all_samples(final, params):
        message, finish_reason = tools.message(c)
        choices.append(p.ChatCompletionChoice(
            index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c.logprobs, params) if c.logprobs is not None else None,
            prompt_logprobs=scoring.prompt_logprobs(final, body.prompt_logprobs)))
    return p.ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage_info([final]))


async def chat_chunks(stream: RequestStream, request_id: str, model: str, params: SamplingParams,
                       include_usage: bool, tools: ToolPlan) -> AsyncIterator[p.ChatCompletionChunk]:
    created = int(time.time())

    def chunk(choices: list[p.ChatCompletionStreamChoice], usage: p.UsageInfo | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

    sent = [Sent() for _ in range(params.n)]
    choice_streams = [tools.stream() for _ in range(params.n)]
    for i in range(params.n):  # the role first, as OpenAI does
        yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
    last: RequestOutput | None = None
    async for out in stream:
        last = out
        for c in out.outputs:
            s = sent[c.index]
            if s.done:
                continue
            text, logprobs = new_text(c, s, params), new_logprobs(c, s)
            s.done = c.finished
            deltas = choice_streams[c.index].deltas(c.text[:s.text], text, s.done)
            if deltas or logprobs or s.done:
                deltas = deltas or [p.DeltaMessage(content="")]
                for j, delta in enumerate(deltas):  # logprobs with the first, finish_reason with the last
                    closing = j == len(deltas) - 1
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=chat_logprobs(logprobs, params) if logprobs is not None and j == 0 else None,
                        finish_reason=choice_streams[c.index].finish_reason(c) if s.done and closing else None,
                        stop_reason=c.stop_reason if closing else None)])
    for i, s in enumerate(sent):  # aborted (server shutting down) before the end
        if not s.done:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(), finish_reason="abort")])
    if include_usage:
        yield chunk([], usage_info([last] if last is not None else []))
