"""--reasoning-parser on a real server: deepseek_r1 takes an output without </think> as
all reasoning (its template opens <think> in the prompt), so the default model's answer
comes back as `reasoning_content`, streamed or not, while an output constrained from its
first token is left whole as `content`."""

from __future__ import annotations

import pytest

from ember import SamplingParams
from test_openai_server import MODEL, serving, still_serving  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    yield from serving(gguf_path, tmp_path_factory, "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_the_reasoning_comes_back_as_reasoning_content_streamed_or_not(client, llm):
    ref = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    text = ref.text
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    choice = client.chat.completions.create(**kw).choices[0]
    message = choice.message
    assert (message.reasoning_content, message.content, choice.finish_reason) == (text, None, ref.finish_reason)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == text and not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_an_output_constrained_from_its_first_token_is_not_split(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=5,
                                         extra_body={"guided_choice": ["Paris", "Rome"]})
    assert (out.choices[0].message.content, out.choices[0].message.reasoning_content) == ("Paris", None)
