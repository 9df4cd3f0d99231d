"""Every engine test ends as it began: no request, KV block or per-request state left behind,
in the session `llm` and in every extra engine a module builds with `extra_llm`."""

import pytest

from ember import LLM


def _saved_llama(tmp_path_factory, name: str, **config):
    """A random Llama (hidden 64, 4 heads, 2 KV heads, seed 0) saved by transformers: (its directory,
    the transformers model in eval mode)."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **config))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A random 2-layer Llama of SmolLM2's vocabulary: a draft that is mostly wrong."""
    return _saved_llama(tmp_path_factory, "draft", vocab_size=49152, num_hidden_layers=2,
                        max_position_embeddings=8192, tie_word_embeddings=True)[0]


@pytest.fixture(scope="module")
def eagle3_target(tmp_path_factory):
    """A tiny random 8-layer Llama target of 64 ids (float32), for EAGLE-3 heads: (its directory,
    the transformers model in eval mode)."""
    return _saved_llama(tmp_path_factory, "target", vocab_size=64, num_hidden_layers=8,
                        max_position_embeddings=4096, tie_word_embeddings=False)


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
