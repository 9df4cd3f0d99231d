"""A failure in one request's own work fails that request alone (finish_reason "error",
RequestFailedError on its stream) while the others get their solo text, on the real model.

The faults are injected into the one piece of per-request work each test is about (its
sampling row, its grammar, its text, its admission): input validation now refuses every
request known to raise there, so an injected exception stands in for the bugs still unknown.
"""

from __future__ import annotations

import asyncio

import pytest
from sampling import greedy

from ember import EngineConfig, SamplingParams, StructuredOutputsParams
from ember.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
OTHER = "Once upon a time"


@pytest.fixture(scope="module")
def engine(gguf_path):
    e = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none", num_kv_blocks=128))
    yield e
    e.stop()


@pytest.fixture(autouse=True)
def nothing_left(engine):
    yield
    if engine.is_running:
        asyncio.run(_settle(engine))
        core = engine.core
        core.block_pool.check_integrity()
        assert core.block_pool.num_in_use == 0 and not core.scheduler.requests and not engine._streams
        assert not core.runner.generators and not core.runner.biases and not core.structured.holds()


async def _settle(engine: AsyncEngine) -> None:
    for _ in range(200):
        if not engine._streams and not engine.core.scheduler.requests and not engine._new:
            return
        await asyncio.sleep(0.02)


async def _text(stream) -> str:
    out = None
    async for out in stream:
        pass
    return out.outputs[0].text


async def _victim_and_casualty(engine: AsyncEngine, victim_params: SamplingParams, casualty_prompt: str,
                               casualty_params: SamplingParams) -> tuple[str, BaseException | None]:
    victim = engine.add_request(OTHER, victim_params)
    casualty = engine.add_request(casualty_prompt, casualty_params)
    results = await asyncio.gather(_text(victim), _text(casualty), return_exceptions=True)
    return results[0], results[1] if isinstance(results[1], BaseException) else None


def _fail_for(match, original, error=RuntimeError("injected")):
    """A stand-in for `original` that raises for the requests `match` picks."""
    def wrapped(*args, **kwargs):
        if match(*args, **kwargs):
            raise error
        return original(*args, **kwargs)
    return wrapped


def test_a_sampling_row_that_fails_fails_only_its_request(engine, llm, monkeypatch):
    want = llm.generate(OTHER, greedy(16))[0].outputs[0].text
    runner = engine.core.runner
    monkeypatch.setattr(runner, "_generator", _fail_for(lambda req, i: req.sampling_params.seed == 666,
                                                        runner._generator))
    text, error = asyncio.run(_victim_and_casualty(engine, greedy(16), FRANCE,
                                                   SamplingParams(seed=666, max_tokens=16)))
    assert text == want
    assert isinstance(error, RequestFailedError)
    assert str(error) == "its sampling parameters could not be applied (RuntimeError)"


def test_output_processing_that_fails_fails_only_its_request(engine, llm, monkeypatch):
    want = llm.generate(OTHER, greedy(16))[0].outputs[0].text
    processor = engine._processor
    monkeypatch.setattr(processor, "_add_text", _fail_for(lambda sample, out: sample.request.prompt == FRANCE,
                                                          processor._add_text))
    text, error = asyncio.run(_victim_and_casualty(engine, greedy(16), FRANCE, greedy(16)))
    assert text == want
    assert isinstance(error, RequestFailedError) and str(error) == "its output could not be processed (RuntimeError)"


def test_a_grammar_that_fails_fails_only_its_request(engine, llm, monkeypatch):
    want = llm.generate(OTHER, greedy(16))[0].outputs[0].text
    structured = engine.core.structured
    monkeypatch.setattr(structured, "bitmasks", lambda plan: (structured._failures.update(
        {c.request.request_id: "structured output failed: RuntimeError" for c in plan.chunks
         if c.request.sampling_params.structured_outputs is not None}) or {}))
    text, error = asyncio.run(_victim_and_casualty(
        engine, greedy(16), FRANCE, greedy(16, structured_outputs=StructuredOutputsParams(choice=["Paris", "Rome"]))))
    assert text == want
    assert isinstance(error, RequestFailedError) and str(error) == "structured output failed: RuntimeError"


def test_a_request_the_core_cannot_add_fails_alone(engine, llm, monkeypatch):
    want = llm.generate(OTHER, greedy(16))[0].outputs[0].text
    core = engine.core
    monkeypatch.setattr(core, "add_request", _fail_for(lambda req: req.prompt == FRANCE, core.add_request))
    text, error = asyncio.run(_victim_and_casualty(engine, greedy(16), FRANCE, greedy(16)))
    assert text == want
    assert isinstance(error, RequestFailedError)
    assert str(error) == "the request could not be added to the engine (RuntimeError)"


def test_scores_with_no_allowed_token_end_the_request_with_an_error_not_text(engine, llm, monkeypatch):
    """NaN logits under a grammar: the sampler flags the row, the request fails; a free
    request in the same steps is untouched (its row is not NaN)."""
    want = llm.generate(OTHER, greedy(8))[0].outputs[0].text
    sample = engine.core.runner.sampler

    def nan_for_constrained_rows(logits, rows):
        for i, r in enumerate(rows):
            if r.allowed is not None:
                logits[i] = float("nan")
        return sample(logits, rows)

    monkeypatch.setattr(engine.core.runner, "sampler", nan_for_constrained_rows)
    text, error = asyncio.run(_victim_and_casualty(
        engine, greedy(8), FRANCE, greedy(8, structured_outputs=StructuredOutputsParams(choice=["Paris", "Rome"]))))
    assert text == want
    assert isinstance(error, RequestFailedError)
    assert str(error).startswith("the model's scores left no token that the output constraint allows")


def test_a_dead_loop_tells_its_owner_and_every_stream(gguf_path, monkeypatch):
    died = []
    engine = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none", num_kv_blocks=64),
                         on_dead=died.append)
    monkeypatch.setattr(engine.core, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))

    async def run():
        with pytest.raises(EngineDeadError, match="boom"):
            await _text(engine.add_request(FRANCE, greedy(4)))
        with pytest.raises(EngineDeadError):
            engine.add_request(FRANCE, greedy(4))

    asyncio.run(run())
    assert [repr(e) for e in died] == ["RuntimeError('boom')"] and not engine.is_running
    engine.stop()
