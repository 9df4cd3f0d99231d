"""POST /v1/chat/completions, and POST /v1/responses and POST /v1/messages (each run as the
chat completion it translates to: responses.py, messages.py): the chat template, tools and
reasoning (tool_calls.py), streamed or not."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember.engine.async_engine import AsyncEngine, RequestStream
from ember.outputs import RequestOutput
from ember.request import Request as EngineRequest
from ember.sampling_params import SamplingParams
from ember.server import protocol as p
from ember.server import scoring
from ember.server.messages import CountTokensRequest, MessageBuilder, MessagesRequest, error_body
from ember.server.responses import ResponseBuilder, ResponsesRequest
from ember.server.serving import (
    ERRORS,
    STREAMED_ERRORS,
    APIError,
    ServerConfig,
    ServerState,
    all_samples,
    engine_prompt,
    final_outputs,
    prepare,
    submit,
    until_disconnected,
    usage_info,
)
from ember.server.streaming import (
    Sent,
    chat_logprobs,
    new_logprobs,
    new_text,
    new_token_ids,
    openai_error_event,
    sse,
    sse_lines,
)
from ember.server.tool_calls import ToolPlan, auto_tool_parser, checked_tools, plan_tools


def add_chat_routes(app: FastAPI, state: ServerState) -> None:
    config = state.config

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=STREAMED_ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        request_id = f"chatcmpl-{body.engine_request_id or uuid.uuid4().hex}"

        def make() -> tuple[SamplingParams, list[EngineRequest], ToolPlan]:
            return chat_requests(engine, config, body, request_id)

        params, requests, tools = await prepare(engine, make)
        streams = submit(engine, requests)
        if body.stream:
            usage = body.include_usage or config.force_include_usage
            chunks = chat_chunks(streams[0], request_id, model, params, usage, tools, body.continuous_usage,
                                 body.return_token_ids)
            return sse(sse_lines(chunks), streams)
        final = (await until_disconnected(raw, final_outputs(streams), streams))[0]
        return JSONResponse(chat_answer(final, params, tools, body, request_id, model).model_dump())

    @app.post("/v1/responses", responses=STREAMED_ERRORS)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API, run as the chat completion it translates to (responses.py)."""
        engine = state.ready_engine()
        model = state.check_model(body.model)
        answer = ResponseBuilder(body, model)
        return await as_chat(engine, config, raw, body.chat_request, answer.id, model, body.stream,
                             lambda chunks, stream: answer.events(chunks), answer.from_chat)


def add_stored_response_routes(app: FastAPI) -> None:
    """GET /v1/responses/{id} and its cancel: ember keeps no responses (store is always false)."""

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], responses=ERRORS)
    @app.post("/v1/responses/{response_id}/cancel", responses=ERRORS)
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"ember keeps no responses, so {response_id[:80]!r} cannot be retrieved (every response "
                            "is as if store were false): keep what you need from the answer itself",
                       param="response_id", code="response_not_found")


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    """Anthropic's Messages API, run as the chat completion it translates to (messages.py)."""
    config = state.config

    @app.post("/v1/messages", responses=STREAMED_ERRORS)
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        answer = MessageBuilder(model)
        return await as_chat(engine, config, raw, body.chat_request, answer.id, model, body.stream,
                             lambda chunks, stream: answer.events(chunks, len(stream.prompt_token_ids)),
                             answer.from_chat, anthropic_error_event)

    @app.post("/v1/messages/count_tokens", responses=ERRORS)
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        engine = state.ready_engine()
        state.check_model(body.model)

        def count() -> int:
            chat = p.ChatCompletionRequest.model_validate(body.chat_request(max_tokens=False))
            tokenizer = engine.inputs.require_tokenizer()
            kwargs = config.default_chat_template_kwargs | chat.template_kwargs(tokenizer.chat_template)
            prompt = engine.inputs.chat_prompt(chat.conversation(), tools=checked_tools(chat.tools), **kwargs)
            return len(prompt["prompt_token_ids"])

        return {"input_tokens": await prepare(engine, count)}


async def as_chat(engine: AsyncEngine, config: ServerConfig, raw: Request, chat_body: Callable[[], dict[str, Any]],
                  answer_id: str, model: str, stream: bool,
                  events: Callable[[AsyncIterator[dict[str, Any]], RequestStream], AsyncIterator[str]],
                  answer: Callable[[dict[str, Any]], dict[str, Any]],
                  error_event: Callable[[APIError], str] = openai_error_event) -> Response:
    """A request of another API (Responses, Messages) run as the chat completion `chat_body()`
    gives (on the input pool): its chunks, as dicts, become `events`; its answer, as a dict,
    becomes `answer`'s."""

    def make() -> tuple[p.ChatCompletionRequest, SamplingParams, list[EngineRequest], ToolPlan]:
        chat = p.ChatCompletionRequest.model_validate(chat_body())
        return chat, *chat_requests(engine, config, chat, answer_id)

    chat, params, requests, tools = await prepare(engine, make)
    streams = submit(engine, requests)
    if stream:
        chunks = chat_chunks(streams[0], answer_id, model, params, True, tools)
        return sse(events((chunk.model_dump() async for chunk in chunks), streams[0]), streams, error_event)
    final = (await until_disconnected(raw, final_outputs(streams), streams))[0]
    return JSONResponse(answer(chat_answer(final, params, tools, chat, answer_id, model).model_dump()))


def anthropic_error_event(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(error_body(error.status, error.message))}\n\n"


def chat_requests(engine: AsyncEngine, config: ServerConfig, body: p.ChatCompletionRequest,
                   request_id: str) -> tuple[SamplingParams, list[EngineRequest], ToolPlan]:
    """A chat request's sampling parameters, its engine request and its tool plan (on the
    input pool: the template and the tools' grammar grow with the input)."""
    tokenizer = engine.inputs.require_tokenizer()
    if body.chat_template is not None and not config.trust_request_chat_template:
        raise p.InvalidRequest("chat_template: this server takes no chat template from a request; start it with "
                               "--trust-request-chat-template to allow it", "chat_template")
    template = body.chat_template or tokenizer.chat_template
    tools = plan_tools(body, auto_tool_parser(config.tool_call_parser, template), config.reasoning_parser)
    params = tools.sampling_params(body.to_sampling_params(config.limits, engine.config.sampling_defaults))
    kwargs = config.default_chat_template_kwargs | body.template_kwargs(template)
    conversation = body.conversation()
    prompt = engine.inputs.chat_prompt(conversation, body.add_generation_prompt, tools=tools.tools,
                                       continue_final_message=body.continue_final_message,
                                       chat_template=body.chat_template, add_special_tokens=body.add_special_tokens,
                                       mm_processor_kwargs=body.mm_processor_kwargs, **kwargs)
    params, tools = tools.gate_reasoning(params, prompt["prompt"], tokenizer, body.thinking_token_budget)
    tools = dataclasses.replace(tools, echo=body.echoed(conversation),
                                as_ids=_as_ids(body, config), include_reasoning=body.include_reasoning)
    prompt = engine_prompt(engine, prompt, truncate=body.truncate_prompt_tokens, cache_salt=body.cache_salt)
    return params, [engine.inputs.make_request(request_id, prompt, params, body.priority)], tools


def _as_ids(body: p.ChatCompletionRequest | p.CompletionRequest, config: ServerConfig) -> bool:
    """Whether logprobs name tokens "token_id:ID": the request's return_tokens_as_token_ids,
    else the server's --return-tokens-as-token-ids."""
    given = body.return_tokens_as_token_ids
    return config.return_tokens_as_token_ids if given is None else given


def chat_answer(final: RequestOutput, params: SamplingParams, tools: ToolPlan, body: p.ChatCompletionRequest,
                 request_id: str, model: str) -> p.ChatCompletionResponse:
    choices = []
    for c in all_samples(final, params):
        message, finish_reason = tools.message(c)
        choices.append(p.ChatCompletionChoice(
            index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c.logprobs, params, tools.as_ids) if c.logprobs is not None else None,
            prompt_logprobs=scoring.prompt_logprobs(final, body.prompt_logprobs),
            token_ids=list(c.token_ids) if body.return_token_ids else None))
    return p.ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage_info([final]),
                                    prompt_token_ids=list(final.prompt_token_ids) if body.return_token_ids else None)


async def chat_chunks(stream: RequestStream, request_id: str, model: str, params: SamplingParams,
                       include_usage: bool, tools: ToolPlan, continuous_usage: bool = False,
                       token_ids: bool = False) -> AsyncIterator[p.ChatCompletionChunk]:
    """`continuous_usage`: every chunk carries the usage so far; `token_ids`: the prompt's
    token ids in the first chunk and each choice's new ones in its chunks (return_token_ids)."""
    created = int(time.time())
    prompt_tokens = len(stream.prompt_token_ids)
    usage_now = p.UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens) if continuous_usage else None

    def chunk(choices: list[p.ChatCompletionStreamChoice], usage: p.UsageInfo | None = None,
              **fields: Any) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                     usage=usage or usage_now, **fields)

    sent = [Sent() for _ in range(params.n)]
    choice_streams = [tools.stream() for _ in range(params.n)]
    for i in range(params.n):  # the role first, as OpenAI does (and vLLM's echo after it)
        yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))],
                    prompt_token_ids=list(stream.prompt_token_ids) if token_ids and i == 0 else None)
        if tools.echo:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(content=tools.echo))])
    last: RequestOutput | None = None
    async for out in stream:
        last = out
        if continuous_usage:
            usage_now = usage_info([out])
        for c in out.outputs:
            s = sent[c.index]
            if s.done:
                continue
            text, logprobs = new_text(c, s, params), new_logprobs(c, s)
            ids = new_token_ids(c, s) if token_ids else None
            s.done = c.finished
            deltas = choice_streams[c.index].deltas(c.text[:s.text], text, s.done)
            if deltas or logprobs or s.done or ids:
                deltas = deltas or [p.DeltaMessage(content="")]
                for j, delta in enumerate(deltas):  # logprobs and token ids with the first, finish_reason with the last
                    closing = j == len(deltas) - 1
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=chat_logprobs(logprobs, params, tools.as_ids) if logprobs is not None and j == 0
                        else None,
                        finish_reason=choice_streams[c.index].finish_reason(c) if s.done and closing else None,
                        stop_reason=c.stop_reason if closing else None,
                        token_ids=(ids if j == 0 else []) if ids is not None else None)])
    for i, s in enumerate(sent):  # aborted (server shutting down) before the end
        if not s.done:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(), finish_reason="abort")])
    if include_usage:
        yield chunk([], usage_info([last] if last is not None else []))
