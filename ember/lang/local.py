"""LocalBackend: programs on an engine in this process (an `LLM`, or an `AsyncEngine`), no
HTTP and no re-tokenizing: each call's prompt is the state's token ids.

Many program states call at once (fork's children, run_batch's programs), from their own
threads. With an LLM, whose core steps on the thread that drives it, one thread of the
backend's drives it while calls are open and ends when none is (the LLM is the backend's
while a program runs: do not call LLM.generate from another thread meanwhile). With an
AsyncEngine, the calls run as tasks on an event loop of the backend's own thread."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

from ember.engine.core_client import ABORT, ADD, send_text_verdicts
from ember.lang.backend import Backend, GenResult, ScoreResult
from ember.outputs import RequestOutput
from ember.request import Request
from ember.sampling_params import SamplingParams
from ember.sglang_params import finish_reason, sampling_params_from_sglang, token_logprobs

OnOutput = Callable[[RequestOutput], None]


class _Call:
    """Requests sent together, done when each has finished (or one failed)."""

    def __init__(self, requests: list[Request], on_output: OnOutput | None) -> None:
        self.requests = requests
        self.on_output = on_output
        self.outputs: dict[str, RequestOutput] = {}
        self.done = threading.Event()
        self.error: BaseException | None = None

    def deliver(self, out: RequestOutput) -> None:
        if self.on_output is not None and not self.done.is_set():
            try:
                self.on_output(out)
            except BaseException as e:  # the program's callback: its state fails, the engine goes on
                self.fail(e)
        if out.finished:
            self.outputs[out.request_id] = out
            if len(self.outputs) == len(self.requests):
                self.done.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.done.set()

    def wait(self) -> list[RequestOutput]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        for out in self.outputs.values():
            if out.error is not None or any(c.finish_reason in ("error", "abort") for c in out.outputs):
                raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")
        return [self.outputs[r.request_id] for r in self.requests]


class _LLMDriver:
    """Steps an LLM's in-process core on a thread of its own while calls are open."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._lock = threading.Lock()
        self._new: list[_Call] = []
        self._open: dict[str, _Call] = {}
        self._running = False

    def submit(self, call: _Call) -> None:
        with self._lock:
            self._new.append(call)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="ember-lang-driver", daemon=True).start()
        self.llm.client.wake()

    def _run(self) -> None:
        client, processor = self.llm.client, self.llm.processor
        try:
            while True:
                with self._lock:
                    new, self._new = self._new, []
                for call in new:
                    for req in call.requests:
                        processor.add_request(req)
                        self._open[req.request_id] = call
                        client.send((ADD, req))
                if not self._open:
                    if not processor.groups:  # nothing of ours in flight: the core's async step is settled
                        client.settle()
                    with self._lock:
                        if not self._new:
                            self._running = False
                            return
                    continue
                step = client.get_step()
                if step is None:
                    continue
                done = processor.process(step.outputs, False)
                send_text_verdicts(client, done)
                for out in done.outputs:
                    call = self._open.get(out.request_id)
                    if call is not None:
                        call.deliver(out)
                        if out.finished:
                            del self._open[out.request_id]
                        if call.done.is_set() and call.error is not None:  # a failed callback: stop its requests
                            self._abort(call)
        except BaseException as e:  # the engine failed: every open call fails with it
            with self._lock:
                calls = set(self._open.values()) | set(self._new)
                self._new, self._running = [], False
            for call in calls:
                call.fail(e)
            self._open.clear()

    def _abort(self, call: _Call) -> None:
        for req in call.requests:
            if self._open.pop(req.request_id, None) is not None:
                self.llm.client.send((ABORT, req.request_id))
                self.llm.processor.abort(req.request_id)


_llm_drivers_lock = threading.Lock()


def _llm_driver(llm: Any) -> _LLMDriver:
    """The one driver of `llm`, kept on it: backends on the same LLM share it (one thread
    steps its core)."""
    with _llm_drivers_lock:
        driver = getattr(llm, "_ember_lang_driver", None)
        if driver is None:
            driver = _LLMDriver(llm)
            llm._ember_lang_driver = driver
        return driver


class _AsyncDriver:
    """Runs an AsyncEngine's requests as tasks on an event loop of its own thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="ember-lang-loop", daemon=True).start()

    def submit(self, call: _Call) -> None:
        asyncio.run_coroutine_threadsafe(self._run(call), self.loop)

    async def _run(self, call: _Call) -> None:
        async def one(req: Request) -> None:
            stream = self.engine.submit(req)
            async with stream:
                async for out in stream:
                    call.deliver(out)

        try:
            await asyncio.gather(*(one(r) for r in call.requests))
        except BaseException as e:
            call.fail(e)

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class LocalBackend(Backend):
    """A program's backend on `engine`: an ember `LLM` or an `AsyncEngine` of this process."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        from ember.engine.async_engine import AsyncEngine

        self.engine = engine
        self.inputs = engine.inputs
        self.tokenizer = engine.inputs.require_tokenizer()
        self.driver = _AsyncDriver(engine) if isinstance(engine, AsyncEngine) else _llm_driver(engine)
        self._ids = itertools.count()

    # -- the tokenizer and the chat template ------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.inputs.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens)

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=False)

    # -- the model -------------------------------------------------------------------------

    def _send(self, prompts: list[list[int]], params: list[SamplingParams],
              on_output: OnOutput | None = None) -> list[RequestOutput]:
        requests = [self.inputs.make_request(f"lang-{next(self._ids)}", {"prompt_token_ids": ids}, p)
                    for ids, p in zip(prompts, params)]  # bad input raises here, before anything is sent
        call = _Call(requests, on_output)
        self.count_call(len(requests))
        self.driver.submit(call)
        return call.wait()

    def generate(self, input_ids: list[int], sampling: dict[str, Any], logprobs: dict[str, Any],
                 on_text: Callable[[str], None] | None = None) -> GenResult:
        params = sampling_params_from_sglang(sampling)
        if logprobs.get("return_logprob"):
            params.logprobs = int(logprobs.get("top_logprobs_num") or 0)
        on_output = (lambda out: on_text(out.outputs[0].text)) if on_text is not None else None
        out = self._send([input_ids], [params], on_output)[0]
        return gen_result(out, logprobs)

    def score(self, prefix: list[int], choices: list[list[int]], unconditional: bool) -> ScoreResult:
        prompts = [prefix + c for c in choices]
        params = [SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0, prompt_logprobs_start=len(prefix))
                  for _ in choices]
        if unconditional:
            prompts += choices
            params += [SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0) for _ in choices]
        outs = self._send(prompts, params)

        def own(out: RequestOutput, start: int) -> list[float | None]:
            ids = out.prompt_token_ids
            return [None if e is None else e[ids[i]].logprob for i, e in enumerate(out.prompt_logprobs) if i >= start]

        n = len(choices)
        return ScoreResult([own(o, len(prefix)) for o in outs[:n]],  # type: ignore[misc]
                           [own(o, 0) for o in outs[n:]] if unconditional else None,
                           [len(o.prompt_token_ids) for o in outs[:n]], [o.num_cached_tokens for o in outs[:n]])

    def flush_cache(self) -> bool:
        """Empty the prefix cache (False while a request runs)."""
        if isinstance(self.driver, _AsyncDriver):
            call = self.engine.call("reset_prefix_cache")
            return bool(asyncio.run_coroutine_threadsafe(call, self.driver.loop).result())
        return bool(self.engine.engine.reset_prefix_cache())

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.config.model, "max_model_len": self.engine.config.max_model_len}

    def shutdown(self) -> None:
        if isinstance(self.driver, _AsyncDriver):
            self.driver.shutdown()


def gen_result(out: RequestOutput, logprobs: dict[str, Any]) -> GenResult:
    """A finished request's GenResult; `logprobs`: the gen's return_logprob, top_logprobs_num,
    return_text_in_logprobs."""
    sample = out.outputs[0]
    chosen, tops = (token_logprobs(out, bool(logprobs.get("return_text_in_logprobs")),
                                   int(logprobs.get("top_logprobs_num") or 0))
                    if logprobs.get("return_logprob") else (None, None))
    return GenResult(sample.text, list(sample.token_ids), finish_reason(out), len(out.prompt_token_ids),
                     out.num_cached_tokens, chosen, tops)
