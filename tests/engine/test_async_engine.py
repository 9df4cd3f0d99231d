"""AsyncEngine: the engine loop on its own thread behind asyncio, on the real model.

Outputs equal the offline API's (the session `llm` fixture); a stream closed or cancelled
early frees its request at once; bad input is refused before the engine thread sees it;
a dead loop fails its streams and refuses new requests; shutdown lets in-flight requests
finish. After each test the engine holds no block and no request.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sampling import greedy

from ember import EngineConfig, SamplingParams
from ember.engine.async_engine import AsyncEngine, EngineStoppedError

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def engine(gguf_path):
    e = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none"))
    yield e
    e.stop()


def wait_idle(engine: AsyncEngine, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while engine.current_stats().num_kv_blocks_in_use or engine.current_stats().num_running \
            or engine.current_stats().num_waiting or engine._streams:
        assert time.monotonic() < deadline, f"not idle: {engine.current_stats()}"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "engine" in request.fixturenames:
        e = request.getfixturevalue("engine")
        if e.is_running:
            wait_idle(e)
            e.core.block_pool.check_integrity()


async def last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_concurrent_requests_equal_offline(engine, llm):
    params = [greedy(10), greedy(10, stop=["\n"]), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8),
              greedy(6, logprobs=2)]
    refs = [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, params)]

    async def run():
        return await asyncio.gather(*[last(engine.add_request(p, sp)) for p, sp in zip(PROMPTS, params)])

    outs = asyncio.run(run())
    for out, ref in zip(outs, refs):
        assert out.finished
        assert [c.text for c in out.outputs] == [c.text for c in ref.outputs]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        assert [c.finish_reason for c in out.outputs] == [c.finish_reason for c in ref.outputs]
    assert outs[3].outputs[0].logprobs is not None and len(outs[3].outputs[0].logprobs) == 6


def test_streams_grow_monotonically_to_the_final_text(engine, llm):
    ref = llm.generate(FRANCE, greedy(12))[0].outputs[0].text

    async def run():
        return [o.outputs[0].text async for o in engine.generate(FRANCE, greedy(12))]

    texts = asyncio.run(run())
    assert texts[-1] == ref
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("how", ["abort", "break-and-aclose", "cancel"])
def test_a_stream_given_up_early_frees_its_request(engine, how):
    async def run():
        if how == "cancel":
            async def consume():
                async for _ in engine.add_request(FRANCE, greedy(2000, ignore_eos=True)):
                    pass
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.5)
            assert engine.current_stats().num_kv_blocks_in_use > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return
        gen = engine.generate(FRANCE, greedy(2000, ignore_eos=True)) if how != "abort" else \
            engine.add_request(FRANCE, greedy(2000, ignore_eos=True))
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        assert engine.current_stats().num_kv_blocks_in_use > 0
        await gen.aclose() if how != "abort" else gen.abort()

    asyncio.run(run())
    wait_idle(engine)


def test_bad_input_is_refused_before_the_engine_thread(engine):
    async def run():
        for prompt, params, words in [
            ("", lambda: greedy(4), "empty"),
            ({"prompt_token_ids": [1, 10**7]}, lambda: greedy(4), "[0, 49152)"),
            ({"prompt_token_ids": [1] * 9000}, lambda: greedy(4), "max_model_len"),
            ("x" * (8192 * 81 + 1), lambda: greedy(4), "characters, more than 8192 tokens"),
            (FRANCE, lambda: greedy(4, logit_bias={10**7: 1.0}), "logit_bias"),
            (FRANCE, lambda: greedy(4, stop_token_ids=[-1]), "stop_token_ids"),
            (FRANCE, lambda: greedy(4, seed=2**64), "seed"),
            (FRANCE, lambda: greedy(4, logprobs=10**6), "logprobs"),
            (FRANCE, lambda: SamplingParams(n=1000), "max_num_seqs"),
        ]:
            with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
                engine.add_request(prompt, params())
        assert not engine._new and not engine._streams
        assert (await last(engine.add_request(FRANCE, greedy(2)))).outputs[0].text == " Paris."

    asyncio.run(run())


def test_shutdown_lets_in_flight_requests_finish_then_refuses(gguf_path, llm):
    ref = llm.generate(FRANCE, greedy(20, ignore_eos=True))[0].outputs[0].text
    engine = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none", num_kv_blocks=64))

    async def run():
        stream = engine.add_request(FRANCE, greedy(20, ignore_eos=True))
        pending = asyncio.create_task(last(stream))
        await asyncio.sleep(0.1)
        await engine.shutdown(timeout=60)
        out = await pending
        assert out.finished and out.outputs[0].text == ref
        with pytest.raises(EngineStoppedError):
            engine.add_request(FRANCE, greedy(2))

    asyncio.run(run())
    assert not engine._thread.is_alive() and not engine.is_running


def test_a_dead_engine_loop_fails_its_streams_and_refuses_new_requests(gguf_path, monkeypatch):
    engine = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none", num_kv_blocks=64))

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.core, "step", broken_step)

    async def run():
        with pytest.raises(EngineStoppedError, match="boom"):
            await last(engine.add_request(FRANCE, greedy(4)))
        with pytest.raises(EngineStoppedError):
            engine.add_request(FRANCE, greedy(4))

    asyncio.run(run())
    assert not engine.is_running
    engine.stop()


def test_the_cores_operations_run_between_steps_in_process_too(engine):
    prompt = " ".join(PROMPTS) * 2  # a few full blocks

    async def run():
        first = await last(engine.add_request(prompt, greedy(3)))
        assert (await last(engine.add_request(prompt, greedy(3)))).num_cached_tokens > 0
        assert await engine.call("reset_prefix_cache") is True
        assert (await last(engine.add_request(prompt, greedy(3)))).num_cached_tokens == 0
        await engine.call("sleep", 1)
        assert (engine.sleeping, engine.core.sleeping, engine.core.runner.kv_cache) == (1, 1, None)
        with pytest.raises(ValueError, match="asleep already"):
            await engine.call("sleep", 2)
        await engine.call("wake_up")
        again = await last(engine.add_request(prompt, greedy(3)))
        assert again.outputs[0].token_ids == first.outputs[0].token_ids and again.num_cached_tokens == 0
        with pytest.raises(ValueError, match="has no operation 'shutdown'"):
            await engine.call("shutdown")

    asyncio.run(run())
