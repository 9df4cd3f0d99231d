"""SGLang's native API, as its runtime serves it (what `sglang`'s RuntimeEndpoint and
ember.lang's talk to):

    POST /generate        text or input_ids (one, or a batch), sampling_params in SGLang's
                          names, return_logprob / logprob_start_len / top_logprobs_num /
                          return_text_in_logprobs, stream (SSE of the text so far, then [DONE])
    GET  /get_model_info  the model's path and kind
    GET  /get_server_info the engine's settings
    POST /flush_cache     empty the prefix cache (400 while requests run)

A field ember does not honour is refused with a 400 naming it (the request model forbids
unknown fields; ember.sglang_params names the sampling ones)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

import ember
from ember.loader.tokenizer import Tokenizer
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.server.limits import MAX_STOP_CHARS, RequestLimits
from ember.server.serving import (
    ERRORS,
    STREAMED_ERRORS,
    APIError,
    ServerState,
    final_outputs,
    merge,
    prepare,
    submit,
    until_disconnected,
)
from ember.server.streaming import Sent, new_text, sse
from ember.sglang_params import finish_reason, sampling_params_from_sglang, token_logprobs


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput, the fields ember honours."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None  # -1 or None: no prompt logprobs
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None

    def items(self) -> list[dict[str, Any]]:
        """One dict per prompt of the batch (a single prompt: one), each field its own value."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", param="text")
        prompts: list[Any]
        if self.text is not None:
            batched = isinstance(self.text, list)
            prompts = list(self.text) if batched else [self.text]
        else:
            batched = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            prompts = [{"prompt_token_ids": ids} for ids in (self.input_ids if batched else [self.input_ids])]
        if batched and not prompts:
            raise APIError(400, "the batch is empty", param="text")
        n = len(prompts)

        def each(name: str, value: Any) -> list[Any]:
            if isinstance(value, list) and (batched or name == "rid"):
                if len(value) != n:
                    raise APIError(400, f"{name} has {len(value)} values for {n} prompts", param=name)
                return value
            if isinstance(value, list):
                raise APIError(400, f"{name} is a list, but one prompt was given", param=name)
            return [value] * n

        columns = {name: each(name, getattr(self, name)) for name in
                   ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid")}
        return [{"prompt": prompts[i], "batched": batched, **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def add_sglang_routes(app: FastAPI, state: ServerState) -> None:
    config = state.config
    limits = config.limits
    ids = iter(range(1 << 62))

    @app.post("/generate", responses=STREAMED_ERRORS)
    async def generate(body: GenerateRequest, raw: Request) -> Any:
        engine = state.ready_engine()
        items = body.items()
        if body.stream and items[0]["batched"]:
            raise APIError(400, "stream takes one prompt: send the batch's prompts as requests of their own",
                           param="stream")

        if len(items) > limits.max_prompts:
            raise APIError(400, f"at most {limits.max_prompts} prompts a request (--max-prompts-per-request); got "
                                f"{len(items)}", param="text")

        def make() -> list:
            requests = []
            for item in items:
                try:
                    params = sampling_params_from_sglang(item["sampling_params"])
                except ValueError as e:
                    raise APIError(400, str(e), param="sampling_params") from None
                _check_limits(params, item, limits)
                rid = item["rid"] if item["rid"] is not None else f"generate-{next(ids)}"
                req = engine.inputs.make_request(rid, item["prompt"], params)
                if item["return_logprob"]:  # SGLang's default start (None, -1): the prompt's last token
                    start = item["logprob_start_len"]
                    item["logprob_start_len"] = req.num_prompt_tokens - 1 if start is None or start < 0 else start
                    top = item["top_logprobs_num"] or 0
                    params.logprobs, params.prompt_logprobs = top, top
                    params.prompt_logprobs_start = item["logprob_start_len"]
                requests.append(req)
            return requests

        requests = await prepare(engine, make)
        started = time.monotonic()
        streams = submit(engine, requests)
        with_text = engine.inputs.tokenizer if body.return_text_in_logprobs else None
        if body.stream:
            return sse(_stream(streams, items[0], requests[0], with_text, started), streams)
        outs = await until_disconnected(raw, final_outputs(streams), streams)
        answers = [_answer(out, item, with_text, started, out.outputs[0].text)
                   for out, item in zip(outs, items)]
        return answers if items[0]["batched"] else answers[0]

    @app.get("/get_model_info", responses=ERRORS)
    async def get_model_info() -> dict[str, Any]:
        engine = state.ready_engine()
        return {"model_path": engine.config.model, "tokenizer_path": engine.config.tokenizer or engine.config.model,
                "served_model_name": config.model_name, "is_generation": engine.config.runner == "generate",
                "has_image_understanding": False, "has_audio_understanding": False, "preferred_sampling_params": None,
                "weight_version": "default"}

    @app.get("/get_server_info", responses=ERRORS)
    async def get_server_info() -> dict[str, Any]:
        engine = state.ready_engine()
        ec = engine.config
        stats = engine.current_stats()
        return {"version": ember.__version__, "model_path": ec.model, "served_model_name": config.model_name,
                "context_length": ec.max_model_len, "max_running_requests": ec.max_num_seqs,
                "chunked_prefill_size": ec.max_num_batched_tokens, "page_size": ec.block_size,
                "max_total_num_tokens": engine.num_kv_blocks * ec.block_size, "disable_radix_cache":
                    not ec.enable_prefix_caching,
                "internal_states": [{"num_running_requests": stats.num_running,
                                     "num_waiting_requests": stats.num_waiting}]}

    @app.api_route("/flush_cache", methods=["GET", "POST"], response_class=PlainTextResponse, responses=ERRORS)
    async def flush_cache() -> PlainTextResponse:
        engine = state.ready_engine()
        if not await engine.call("reset_prefix_cache"):
            raise APIError(400, "requests are running or waiting: the cache is flushed only when the engine is idle",
                           code="busy")
        return PlainTextResponse("Cache flushed.\n")


def _check_limits(params: SamplingParams, item: dict[str, Any], limits: RequestLimits) -> None:
    """The server's caps (`ember serve --max-...`) on one prompt's request."""
    for name, value, cap, flag in (("n", params.n, limits.max_n, "--max-n"),
                                   ("stop", len(params.stop), limits.max_stop, "--max-stop-strings"),
                                   ("logit_bias", len(params.logit_bias or ()), limits.max_logit_bias,
                                    "--max-logit-bias"),
                                   ("top_logprobs_num", item["top_logprobs_num"] or 0, limits.max_logprobs,
                                    "--max-logprobs")):
        if value > cap:
            raise APIError(400, f"{name}: at most {cap} ({flag}); got {value}", param=name)
    if any(len(stop) > MAX_STOP_CHARS for stop in params.stop):
        raise APIError(400, f"a stop string has at most {MAX_STOP_CHARS} characters", param="stop")


async def _stream(streams, item: dict[str, Any], request, tokenizer: Tokenizer | None, started: float) -> AsyncIterator[str]:
    """SSE events of the text so far (SGLang's: each event the whole text), then [DONE]."""
    sent = Sent()
    async for _, out in merge(streams):
        new_text(out.outputs[0], sent, request.sampling_params)
        answer = _answer(out, item, tokenizer, started, out.outputs[0].text[:sent.text])
        yield f"data: {json.dumps(answer)}\n\n"
    yield "data: [DONE]\n\n"


def _answer(out: RequestOutput, item: dict[str, Any], tokenizer: Tokenizer | None, started: float,
            text: str) -> dict[str, Any]:
    """SGLang's response to one prompt: text, output_ids and meta_info (logprobs as
    (logprob, token id, its text where `tokenizer` is given, else None) tuples)."""
    sample = out.outputs[0]
    meta: dict[str, Any] = {"id": out.request_id, "finish_reason": finish_reason(out) if out.finished else None,
                            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(sample.token_ids),
                            "cached_tokens": out.num_cached_tokens, "e2e_latency": time.monotonic() - started}
    if item["return_logprob"]:
        top = item["top_logprobs_num"] or 0
        chosen, tops = token_logprobs(out, tokenizer is not None, top)
        meta["output_token_logprobs"] = chosen
        meta["output_top_logprobs"] = tops if top else None
        word = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
        entries = out.prompt_logprobs or []
        inputs, input_tops = [], []
        for position, token in enumerate(out.prompt_token_ids[item["logprob_start_len"]:],
                                         start=item["logprob_start_len"]):
            entry = entries[position] if position < len(entries) else None
            inputs.append((None if entry is None else entry[token].logprob, token, word(token)))
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top] if entry is not None else []
            input_tops.append([(e.logprob, t, word(t)) for t, e in ranked])
        meta["input_token_logprobs"] = inputs
        meta["input_top_logprobs"] = input_tops if top else None
    return {"text": text, "output_ids": list(sample.token_ids), "meta_info": meta}
