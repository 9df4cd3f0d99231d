"""AsyncEngine with the engine core in its own process (core_process=True, what `ember
serve` runs) against the same engine with the core on its output thread: the same outputs,
bit for bit, for 64 concurrent mixed requests on the default model (its GGUF path is
batch-invariant, so the two processes' different timing cannot change a token), and a
killed core process fails every stream, marks the engine dead and makes /health 503."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from ember.config import EngineConfig
from ember.engine.async_engine import AsyncEngine, EngineDeadError
from ember.engine.core import EngineCoreOutput
from ember.engine.core_client import CoreDeadError, output_row, stats_row
from ember.engine.stats import EngineStats
from ember.runner.model_runner import PromptLogprobs
from ember.runner.sampler import TokenLogprobs
from ember.sampling_params import SamplingParams, StructuredOutputsParams


def test_the_wire_rows_carry_every_field():
    """What the core process sends is EngineCoreOutput's and EngineStats' fields in order: a
    field added to either and not to its row fails here, not in a served request."""
    lp = TokenLogprobs(5, -0.25, 1, [5, 7], [-0.25, -2.0])
    out = EngineCoreOutput("r#1", [5, 9], True, [lp, lp], PromptLogprobs(1, [lp]), [0.5], "r", 1, "stop", "\n",
                           "why", 32, 1.5, 2.5)
    assert [getattr(out, f) for f in EngineCoreOutput.__slots__] == list(output_row(out))
    assert EngineCoreOutput(*output_row(out)) == out
    stats = EngineStats(1, 2, 3, 4, 5, 6, 7)
    assert EngineStats(*stats_row(stats)) == stats and len(stats_row(stats)) == len(dataclasses.fields(EngineStats))


PROMPTS = ["Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "The quick brown fox", "Water boils at",
           "My favourite colour is", "In 1492, Columbus", "Roses are red,"]


def _params(i: int) -> SamplingParams:
    kind = i % 6
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=10 + i % 7)
    if kind == 1:
        return SamplingParams(temperature=0.9, seed=i, n=3, max_tokens=12)
    if kind == 2:
        return SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2)
    if kind == 3:
        return SamplingParams(temperature=0, max_tokens=30, stop=["\n", " the"])
    if kind == 4:
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        return SamplingParams(temperature=0.7, seed=i, max_tokens=30,
                              structured_outputs=StructuredOutputsParams(json=schema))
    return SamplingParams(temperature=0, max_tokens=8, min_tokens=4, repetition_penalty=1.3)


async def _run(engine: AsyncEngine, n: int = 64):
    async def one(i: int):
        out = None
        async for out in engine.generate(PROMPTS[i % len(PROMPTS)], _params(i), request_id=f"r{i}"):
            pass
        return out

    return await asyncio.gather(*[one(i) for i in range(n)])


@pytest.fixture(scope="module")
def config(gguf_path) -> EngineConfig:
    return EngineConfig(model=str(gguf_path), num_kv_blocks=512).resolve()


@pytest.mark.slow
def test_64_mixed_requests_give_the_in_process_outputs(config):
    one_process = AsyncEngine(config)
    try:
        want = asyncio.run(_run(one_process))
        one_process.core.check_idle()
    finally:
        one_process.stop()
    engine = AsyncEngine(config, core_process=True)
    try:
        assert engine.core_pid != os.getpid() and engine.num_kv_blocks == 512
        got = asyncio.run(_run(engine))
        stats = engine.current_stats()
        assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_in_use == 0
    finally:
        engine.stop()
    # a prompt shorter than a block hits only a finished request's partly filled block, and
    # which have finished when a request arrives depends on the processes' timing (in either
    # run there may be none): everything else must agree
    assert all(o.num_cached_tokens <= len(o.prompt_token_ids) for o in got + want)
    assert [dataclasses.replace(o, num_cached_tokens=0) for o in got] == \
        [dataclasses.replace(o, num_cached_tokens=0) for o in want]
    assert [len(o.outputs) for o in got[1:7]] == [3, 1, 1, 1, 1, 1]
    assert got[2].prompt_logprobs is not None and len(got[2].outputs[0].logprobs) == 12
    assert any(o.outputs[0].stop_reason in ("\n", " the") for o in got[3::6])


@pytest.mark.slow
def test_a_killed_core_process_fails_every_stream_and_health_says_503(config):
    from ember.server.serving import APIError, ServerConfig, ServerState

    died: list[BaseException] = []
    engine = AsyncEngine(config, core_process=True, on_dead=died.append)
    try:
        async def run() -> list[BaseException | None]:
            streams = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
                       for p in PROMPTS]
            async def drain(stream) -> BaseException | None:
                try:
                    async for _ in stream:
                        pass
                except BaseException as e:
                    return e
                return None

            tasks = [asyncio.ensure_future(drain(s)) for s in streams]
            while engine.current_stats().num_running < len(PROMPTS):
                await asyncio.sleep(0.01)
            os.kill(engine.core_pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

        errors = asyncio.run(run())
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert isinstance(engine.error, CoreDeadError) and died == [engine.error]
        assert str(engine.error) == "the engine core process exited (exit code -9)"
        assert not engine.is_running
        state = ServerState(ServerConfig(config, ("m",)), engine)
        with pytest.raises(APIError) as refused:
            state.ready_engine()
        assert refused.value.status == 503 and "the engine loop died" in refused.value.message
        with pytest.raises(EngineDeadError):
            asyncio.run(_run(engine, 1))
    finally:
        engine.stop()


@pytest.mark.slow
def test_stop_ends_the_core_process(config):
    engine = AsyncEngine(config, core_process=True)
    pid = engine.core_pid
    out = asyncio.run(_run(engine, 2))
    assert out[0].outputs[0].finish_reason == "length"
    engine.stop()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
