"""Every engine test ends as it began: no request, KV block or per-request state left behind,
in the session `llm` and in every extra engine a module builds with `extra_llm`."""

import pytest

from ember import LLM


@pytest.fixture(scope="session")
def live_engines() -> list:
    return []


@pytest.fixture(scope="module")
def extra_llm(gguf_path, live_engines):
    """Build an LLM on the default model with other engine args (dequantized float32, as the
    session `llm`, unless they say otherwise), for this module only."""
    made: list[LLM] = []

    def make(**engine_args) -> LLM:
        llm = LLM(str(gguf_path), **({"quantization": "none", "dtype": "float32"} | engine_args))
        made.append(llm)
        live_engines.append(llm)
        return llm

    yield make
    for llm in made:
        live_engines.remove(llm)


@pytest.fixture(autouse=True)
def engines_idle(llm, live_engines):
    for engine in [llm, *live_engines]:
        engine.check_idle()
    yield
    for engine in [llm, *live_engines]:
        engine.check_idle()



@pytest.fixture
def fail_launch(monkeypatch):
    """fail_launch(llm, at_call): the runner's `at_call`-th launch from now raises
    RuntimeError("boom") (a fault mid-generation); the others run for real.
    `monkeypatch.undo()` restores it."""
    def arm(llm: LLM, at_call: int) -> None:
        real_launch, calls = llm.engine.runner.launch, []

        def failing_launch(plan, *args):
            calls.append(plan)
            if len(calls) == at_call:
                raise RuntimeError("boom")
            return real_launch(plan, *args)

        monkeypatch.setattr(llm.engine.runner, "launch", failing_launch)

    return arm
