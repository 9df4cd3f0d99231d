"""generation_config.json's sampling defaults (vLLM's --generation-config auto): temperature,
top_p, top_k, min_p and repetition_penalty apply where a request leaves them unset, offline
(`LLM.get_default_sampling_params()`, `generate(..., sampling_params=None)`) and served
(request fields left out); generation_config="vllm" turns them off. do_sample and
max_new_tokens are not read, as in vLLM. On a tiny Llama with seeded random weights."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from ember import LLM, EngineConfig, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.model_files import locate_model
from ember.models.config import ModelConfig
from ember.server.limits import RequestLimits
from ember.server.protocol import ChatCompletionRequest, CompletionRequest

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
TINY_ARGS = {"num_kv_blocks": 16, "block_size": 16, "dtype": "float32"}
GENERATION = {"do_sample": False, "max_new_tokens": 5, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
              "min_p": 0.05, "repetition_penalty": 1.1, "bos_token_id": 1, "eos_token_id": 2}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
IDS = [5, 17, 99, 3, 250, 41, 8]


def write_model(path: Path, generation: dict | None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY))
    weights = iter_dummy_weights(ModelConfig.from_hf_config(TINY), seed=0)
    save_file({k: v.contiguous() for k, v in weights}, str(path / "model.safetensors"))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("gen") / "m", GENERATION)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """This module's engine, under the session model's name: the autouse idle check
    (tests/engine/conftest.py) checks it instead of loading SmolLM2."""
    return LLM(str(model_dir), **TINY_ARGS)


def record_requests(engine, method: str, monkeypatch) -> list:
    """The Request objects handed to `engine.<method>` (the real method still runs)."""
    seen = []
    real = getattr(engine, method)

    def recording(req):
        seen.append(req)
        return real(req)

    monkeypatch.setattr(engine, method, recording)
    return seen


# ---- offline --------------------------------------------------------------------------------

def test_the_defaults_are_read_and_logged(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ember.config"):
        config = EngineConfig(model=str(model_dir), **TINY_ARGS).resolve()
    assert dict(config.sampling_defaults) == DEFAULTS
    assert [r.getMessage() for r in caplog.records if r.name == "ember.config"] == [f"default sampling params from generation_config.json: {DEFAULTS} "
                               "(--generation-config vllm turns them off)"]


def test_get_default_sampling_params(llm):
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    assert llm.get_default_sampling_params().max_tokens == 16  # max_new_tokens is not read


def test_generate_without_params_uses_them(llm, monkeypatch):
    seen = record_requests(llm.engine, "add_request", monkeypatch)
    llm.generate({"prompt_token_ids": IDS})
    llm.generate({"prompt_token_ids": IDS}, SamplingParams(temperature=0))  # given: used as given
    list(llm.stream({"prompt_token_ids": IDS}))
    assert [r.sampling_params for r in seen] == [SamplingParams(**DEFAULTS), SamplingParams(temperature=0),
                                                 SamplingParams(**DEFAULTS)]


def test_greedy_default_from_the_file_gives_greedy_tokens(tmp_path):
    # a penalty below 1 favours tokens already seen, so it changes this model's greedy path
    path = write_model(tmp_path / "m", {"temperature": 0.0, "repetition_penalty": 0.2})
    llm = LLM(str(path), **TINY_ARGS)
    ours = llm.generate({"prompt_token_ids": IDS})[0].outputs[0].token_ids
    assert ours == llm.generate({"prompt_token_ids": IDS},
                                SamplingParams(temperature=0, repetition_penalty=0.2))[0].outputs[0].token_ids
    assert ours != llm.generate({"prompt_token_ids": IDS}, SamplingParams(temperature=0))[0].outputs[0].token_ids
    assert len(ours) == 16


def test_generation_config_vllm_turns_them_off(model_dir):
    llm = LLM(str(model_dir), generation_config="vllm", **TINY_ARGS)
    assert dict(llm.config.sampling_defaults) == {}
    assert llm.get_default_sampling_params() == SamplingParams()


def test_no_file_no_defaults(tmp_path, gguf_path):
    assert dict(EngineConfig(model=str(write_model(tmp_path / "m", None))).resolve().sampling_defaults) == {}
    assert locate_model(str(gguf_path), "auto").sampling_defaults() == {}  # GGUF: none


def test_a_bad_value_is_refused_at_load(tmp_path):
    path = write_model(tmp_path / "m", {"temperature": 0.7, "top_p": 0})
    with pytest.raises(ValueError) as info:
        EngineConfig(model=str(path)).resolve()
    assert str(info.value) == (f"{path / 'generation_config.json'}: SamplingParams.top_p must be in (0, 1]; got 0: "
                               "fix the file, or pass generation_config='vllm' (--generation-config vllm) to ignore it")
    assert dict(EngineConfig(model=str(path), generation_config="vllm").resolve().sampling_defaults) == {}


def test_override_generation_config_goes_over_the_file_from_the_command_line_too(model_dir):
    from ember.engine_args import engine_args
    from ember.server.cli import parse_args

    over = '{"temperature": 0.2, "presence_penalty": 0.5}'
    config = EngineConfig(model=str(model_dir), override_generation_config=over, **TINY_ARGS).resolve()
    assert dict(config.sampling_defaults) == DEFAULTS | {"temperature": 0.2, "presence_penalty": 0.5}
    args = engine_args(parse_args(["serve", str(model_dir), "--override-generation-config", over]))
    assert args["override_generation_config"] == over
    only = EngineConfig(model=str(model_dir), generation_config="vllm", override_generation_config={"top_k": 5},
                        **TINY_ARGS).resolve()
    assert dict(only.sampling_defaults) == {"top_k": 5}  # an LLM(...) caller may give a dict
    for bad, says in (('{"max_new_tokens": 5}', "takes an object of temperature"), ("[1]", "got list"),
                      ("{oops", "must be a JSON object"), ('{"top_p": 2}', "SamplingParams.top_p must be in")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(model=str(model_dir), override_generation_config=bad).resolve()


# ---- the server's requests -----------------------------------------------------------------

def test_unset_request_fields_take_the_defaults():
    limits = RequestLimits()
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_sampling_params(limits, DEFAULTS) == SamplingParams(**DEFAULTS, max_tokens=None)
    assert chat.to_sampling_params(limits) == SamplingParams(max_tokens=None)  # OpenAI's: temperature 1
    given = CompletionRequest(prompt="x", temperature=0.2, top_k=-1, repetition_penalty=1.0)
    assert given.to_sampling_params(limits, DEFAULTS) == SamplingParams(
        temperature=0.2, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.0, max_tokens=16)


@pytest.fixture(scope="module")
def served(model_dir):
    """(base url, engine): a real uvicorn serving the tiny model, in this process."""
    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    from ember.engine.async_engine import AsyncEngine
    from ember.server.openai_api import ServerConfig, build_app

    engine = AsyncEngine(EngineConfig(model=str(model_dir), **TINY_ARGS))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(ServerConfig(engine.config, ("tiny",)), engine),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield httpx, f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(30)


def test_served_requests_take_the_defaults(served, monkeypatch):
    httpx, url, engine = served
    seen = record_requests(engine, "submit", monkeypatch)
    for body in ({"prompt": IDS, "max_tokens": 3}, {"prompt": IDS, "max_tokens": 3, "temperature": 0, "top_p": 1}):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    assert [r.sampling_params for r in seen] == [
        SamplingParams(**DEFAULTS, max_tokens=3),
        SamplingParams(temperature=0, top_p=1.0, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=3)]


def test_async_engine_add_request_without_params(served, monkeypatch):
    _, _, engine = served
    seen = record_requests(engine, "submit", monkeypatch)

    async def run() -> list:
        return [out async for out in engine.add_request({"prompt_token_ids": IDS})]

    assert asyncio.run(run())[-1].finished
    assert [r.sampling_params for r in seen] == [SamplingParams(**DEFAULTS)]


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_flags_over_the_defaults_over_greedy():
    from ember.server.cli import add_sampling_args, sampling_params

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    assert sampling_params(parser.parse_args([]), {}) == SamplingParams(temperature=0, max_tokens=256)
    assert sampling_params(parser.parse_args([]), DEFAULTS) == SamplingParams(**DEFAULTS, max_tokens=256, seed=0)
    assert sampling_params(parser.parse_args(["--temperature", "0", "--top-k", "5"]), DEFAULTS) == \
        SamplingParams(**(DEFAULTS | {"temperature": 0, "top_k": 5}), max_tokens=256)
