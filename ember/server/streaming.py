"""Server-sent events and OpenAI's two logprob shapes: what the streaming routes share."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ember.engine.async_engine import EngineStoppedError, RequestFailedError, RequestStream
from ember.outputs import CompletionOutput, Logprob
from ember.sampling_params import SamplingParams
from ember.server import protocol as p
from ember.server import scoring
from ember.server.serving import APIError, engine_error

logger = logging.getLogger("ember.server")

def token_text(lp: Logprob, token_id: int, as_ids: bool = False) -> str:
    """How a logprob names its token: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:ID" (for tokens whose text alone is ambiguous or not valid UTF-8)."""
    if as_ids:
        return f"token_id:{token_id}"
    return lp.decoded_token if lp.decoded_token is not None else f"<{token_id}>"


def chat_logprobs(entries: list[dict[int, Logprob]], params: SamplingParams,
                  as_ids: bool = False) -> p.ChatChoiceLogprobs:
    content = []
    for entry in entries:
        token_id, lp = next(iter(entry.items()))  # the sampled token comes first
        text = token_text(lp, token_id, as_ids)
        tops = [p.TopLogprob(token=(top := token_text(t, tid, as_ids)), logprob=t.logprob, bytes=list(top.encode()))
                for tid, t in scoring.ranked(entry, params.logprobs or 0)]
        content.append(p.ChatCompletionTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()),
                                                    top_logprobs=tops))
    return p.ChatChoiceLogprobs(content=content)


def completion_logprobs(entries: list[dict[int, Logprob]], params: SamplingParams,
                         offset: int, as_ids: bool = False) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for entry in entries:
        token_id, lp = next(iter(entry.items()))
        text = token_text(lp, token_id, as_ids)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.text_offset.append(offset)
        offset += len(text)
        top = {token_text(t, tid, as_ids): t.logprob for tid, t in scoring.ranked(entry, params.logprobs or 0)}
        out.top_logprobs.append(top if params.logprobs else None)
    return out


def openai_error_event(error: APIError) -> str:
    info = p.ErrorInfo(message=error.message, type=error.type, code=error.status)
    return f"data: {p.ErrorResponse(error=info).model_dump_json()}\n\ndata: [DONE]\n\n"


def sse(chunks: AsyncIterator[str], streams: list[RequestStream],
        error_event: Callable[[APIError], str] = openai_error_event) -> StreamingResponse:
    """`error_event`: how the stream ends when it fails (OpenAI's: an error chunk, then [DONE])."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # the stream ends with an error event, then [DONE], as vLLM's do
            if isinstance(e, (EngineStoppedError, RequestFailedError)):
                error = engine_error(e)
            else:
                logger.exception("a stream failed")
                error = APIError(500, "internal server error (see the server log)", "server_error")
            yield error_event(error)
        finally:  # the client went away (cancelled) or we are done: nothing stays in the engine
            for s in streams:
                s.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass
class Sent:
    """How much of one choice the client has: text chars, logprob entries, done or not."""

    text: int = 0
    logprobs: int = 0
    tokens: int = 0  # token ids (return_token_ids)
    done: bool = False


def new_text(c: CompletionOutput, sent: Sent, params: SamplingParams) -> str:
    """Text not sent yet. While running, the last len(longest stop) - 1 chars are held back:
    a stop string found later may cut them off, and sent text cannot be taken back."""
    end = len(c.text)
    if params.stop and not c.finished:
        end = max(sent.text, end - (max(len(s) for s in params.stop) - 1))
    delta = c.text[sent.text:end]
    sent.text = end
    return delta


def new_logprobs(c: CompletionOutput, sent: Sent) -> list[dict[int, Logprob]] | None:
    if c.logprobs is None:
        return None
    new = c.logprobs[sent.logprobs:]
    sent.logprobs = len(c.logprobs)
    return new


def new_token_ids(c: CompletionOutput, sent: Sent) -> list[int]:
    new = list(c.token_ids[sent.tokens:])
    sent.tokens = len(c.token_ids)
    return new


def sse_data(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def sse_lines(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Chunks as server-sent events, then [DONE]."""
    async for chunk in chunks:
        yield sse_data(chunk)
    yield "data: [DONE]\n\n"
