"""POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ember.server import protocol as p
from ember.server import scoring
from ember.server.serving import ERRORS, ServerState, prepare
from ember.server.tool_calls import checked_tools


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    config = state.config

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: p.TokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine()
        state.check_model(body.model)

        def ids() -> list[int]:
            if (body.prompt is None) == (body.messages is None):
                raise p.InvalidRequest("give exactly one of prompt and messages", "prompt")
            if body.messages is not None:
                return engine.inputs.chat_prompt(p.conversation(body.messages), body.add_generation_prompt,
                                                 tools=checked_tools(body.tools),
                                                 mm_processor_kwargs=body.mm_processor_kwargs,
                                                 **config.default_chat_template_kwargs)["prompt_token_ids"]
            for name in ("tools", "mm_processor_kwargs"):
                if getattr(body, name) is not None:
                    raise p.InvalidRequest(f"{name} apply to messages: give messages, not prompt", name)
            return engine.inputs.encode(body.prompt, add_special_tokens=body.add_special_tokens)

        tokens = await prepare(engine, ids)
        return {"count": len(tokens), "max_model_len": config.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: p.DetokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine()
        state.check_model(body.model)

        def text() -> str:
            tokens = p.token_ids(body.tokens, "tokens")
            if len(tokens) > config.engine.max_model_len:  # one decode call holds the interpreter lock
                raise p.InvalidRequest(f"at most max_model_len ({config.engine.max_model_len}) tokens; got "
                                       f"{len(tokens)}", "tokens")
            vocab = engine.inputs.vocab_size
            if tokens and max(tokens) >= vocab:
                raise p.InvalidRequest(f"token ids must be in [0, {vocab}); got {max(tokens)}", "tokens")
            return engine.inputs.require_tokenizer().decode(tokens, body.skip_special_tokens)

        return {"prompt": await prepare(engine, text)}

    @app.get("/tokenizer_info", responses=ERRORS)
    async def tokenizer_info() -> dict[str, Any]:
        engine = state.ready_engine()
        return await prepare(engine, lambda: scoring.tokenizer_info(engine.inputs.require_tokenizer(),
                                                                     config.engine.max_model_len))
