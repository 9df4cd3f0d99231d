"""The `ember` command as a user runs it: generate, one-shot chat, interactive chat."""

import subprocess
import sys

from ember import SamplingParams


def ember(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.server.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_greedy_completion(llm):
    want = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    done = ember("generate", "The capital of France is", "--max-tokens", "12", "--dtype", "float32", "--quantization", "none")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"
    assert "[12 tokens," in done.stderr and "tok/s]" in done.stderr


def test_chat_one_shot_answers(llm):
    done = ember("chat", "-m", "What is the capital of France?", "--dtype", "float32", "--quantization", "none")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The capital of France is Paris.\n"


def test_interactive_chat_keeps_the_history(llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    first = [{"role": "user", "content": "What is the capital of France?"}]
    reply1 = llm.chat(first, params)[0].outputs[0].text
    second = first + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "And of Italy?"}]
    reply2 = llm.chat(second, params)[0].outputs[0].text
    done = ember("chat", "--dtype", "float32", "--quantization", "none", "--max-tokens", "24",
                 stdin="What is the capital of France?\nAnd of Italy?\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"> {reply1}\n> {reply2}\n> "


def test_a_bad_model_path_is_a_clear_error():
    done = ember("generate", "hi", "/nonexistent/model.gguf")
    assert done.returncode == 2
    assert "ember: error: model '/nonexistent/model.gguf' not found" in done.stderr


def test_a_bad_kv_cache_dtype_is_refused_with_the_choices():
    done = ember("serve", "--kv-cache-dtype", "int8")
    assert done.returncode == 2
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in done.stderr
    assert all(choice in done.stderr for choice in ("auto", "'fp8'", "fp8_e4m3"))


def test_async_scheduling_flag_reaches_the_engine_args():
    import argparse

    from ember.server.cli import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args(parser.parse_args([]))["async_scheduling"] is None  # the device decides
    assert engine_args(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert engine_args(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False


def test_model_source_flags_reach_the_engine_args():
    import argparse

    from ember.server.cli import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_args(parser.parse_args(["org/name"]))
    assert {k: defaults[k] for k in ("model", "revision", "download_dir", "tokenizer", "chat_template",
                                     "generation_config")} == \
        {"model": "org/name", "revision": None, "download_dir": None, "tokenizer": None, "chat_template": None,
         "generation_config": "auto"}
    given = engine_args(parser.parse_args(["org/name-GGUF:Q4_K_M", "--revision", "v1", "--download-dir", "/d",
                                           "--tokenizer", "org/tok", "--chat-template", "t.jinja",
                                           "--generation-config", "vllm", "--load-format", "pt"]))
    assert {k: given[k] for k in ("model", "revision", "download_dir", "tokenizer", "chat_template",
                                  "generation_config", "load_format")} == \
        {"model": "org/name-GGUF:Q4_K_M", "revision": "v1", "download_dir": "/d", "tokenizer": "org/tok",
         "chat_template": "t.jinja", "generation_config": "vllm", "load_format": "pt"}


def test_a_hub_id_offline_and_not_cached_is_a_clear_error(tmp_path):
    import os

    done = subprocess.run([sys.executable, "-m", "ember.server.cli", "generate", "hi", "org/absent",
                           "--download-dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert done.stderr.endswith(
        f"ember: error: 'org/absent' is not in the Hugging Face cache ({tmp_path}) and HF_HUB_OFFLINE is set: connect "
        "once (unset HF_HUB_OFFLINE) to download it, point HF_HUB_CACHE or download_dir at a cache that holds it, or "
        "pass a local path\n")
