"""Deployment options of `ember serve`: --config FILE.yaml, --model, --version, CORS
(--allowed-origins, answered preflights) and --enable-log-requests, parsed as the CLI parses
them and on a real server started from a YAML file."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from servers import KEY, MODEL, Server, post, running

import ember
from ember.server.cli import engine_args, main, parse_args

ORIGIN = "http://app.example"


def ember_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.server.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_version_prints_the_package_version():
    done = ember_cli("--version")
    assert (done.returncode, done.stdout) == (0, f"{ember.__version__}\n")


def test_model_flag_is_the_positional_model():
    assert engine_args(parse_args(["serve", "--model", "/m.gguf"]))["model"] == "/m.gguf"
    assert engine_args(parse_args(["serve", "/m.gguf", "--model", "/m.gguf"]))["model"] == "/m.gguf"
    with pytest.raises(ValueError, match=r"the model is given twice, as '/a.gguf' and --model '/b.gguf'"):
        engine_args(parse_args(["serve", "/a.gguf", "--model", "/b.gguf"]))


def test_server_options_are_off_by_default():
    ns = parse_args(["serve"])
    assert (ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials,
            ns.enable_log_requests, ns.config) == (None, ["*"], ["*"], False, False, None)


def test_allowed_origins_take_a_json_list_or_one_origin():
    ns = parse_args(["serve", "--allowed-origins", '["http://a.example", "http://b.example"]',
                     "--allowed-methods", '["GET", "POST"]', "--allow-credentials"])
    assert (ns.allowed_origins, ns.allowed_methods, ns.allow_credentials) == \
        (["http://a.example", "http://b.example"], ["GET", "POST"], True)
    assert parse_args(["serve", "--allowed-origins", "*"]).allowed_origins == ["*"]


def test_config_file_sets_any_flag_and_the_command_line_wins(tmp_path):
    config = tmp_path / "ember.yaml"
    config.write_text("model: /from/file.gguf\nmax_model_len: 512\nport: 9001\nenable-log-requests: true\n"
                      "allowed-origins: ['http://a.example']\nno-jump-forward: true\nenable_prefix_caching: false\n"
                      "gpu-memory-utilization: 1\n")
    ns = parse_args(["serve", "--config", str(config), "--port", "9002"])
    assert (ns.max_model_len, ns.port, ns.enable_log_requests, ns.allowed_origins) == \
        (512, 9002, True, ["http://a.example"])
    args = engine_args(ns)
    assert (args["model"], args["structured_outputs_jump_forward"], args["enable_prefix_caching"],
            args["gpu_memory_utilization"]) == ("/from/file.gguf", False, False, 1.0)
    assert engine_args(parse_args(["serve", "/cli.gguf", "--config", str(config)]))["model"] == "/cli.gguf"
    assert engine_args(parse_args(["serve", "--model", "/cli.gguf", "--config", str(config)]))["model"] == \
        "/cli.gguf"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert engine_args(parse_args(["generate", "hi", "--config", str(empty)]))["model"] is None


@pytest.mark.parametrize("text, message", [
    ("bogus_key: 1\n", "unknown key 'bogus_key': it names no flag of this command"),
    ("dtype: int3\n", "dtype: invalid choice 'int3' (choose from auto, float32, bfloat16, float16)"),
    ("max-model-len: many\n", "max-model-len: invalid int value 'many'"),
    ("enforce-eager: 1\n", "enforce-eager: expected true or false, got 1"),
    ("- a list\n", "the file must hold a mapping of flag names to values"),
])
def test_a_bad_config_file_is_an_error_that_names_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:  # the command's own main, in this process: it exits before any start
        main(["serve", "--config", str(config)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"ember serve: error: --config {config}: {message}"


@pytest.fixture(scope="module")
def configured(gguf_path, tmp_path_factory):
    """A server whose CORS, request logging and API key come from a YAML file."""
    root = tmp_path_factory.mktemp("configured")
    config = root / "serve.yaml"
    config.write_text(f"allowed_origins: ['{ORIGIN}']\nallowed-methods: ['GET', 'POST']\n"
                      f"enable-log-requests: true\napi-key: {KEY}\nmax-model-len: 256\n")
    yield from running(Server(gguf_path, root / "server.log", "--config", str(config)))


def test_a_cors_preflight_is_answered_without_the_api_key(configured):
    r = httpx.options(f"{configured.url}/v1/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-methods"] == "GET, POST"
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in r.headers
    other = httpx.options(f"{configured.url}/v1/completions", timeout=10, headers={
        "Origin": "http://other.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    delete = httpx.options(f"{configured.url}/v1/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "DELETE"})
    assert delete.status_code == 400


def test_responses_carry_the_allowed_origin_and_the_key_still_guards(configured):
    r = httpx.get(f"{configured.url}/v1/models", timeout=10,
                  headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert r.json()["data"][0]["id"] == MODEL
    denied = httpx.get(f"{configured.url}/v1/models", timeout=10, headers={"Origin": ORIGIN})
    assert denied.status_code == 401


def test_enable_log_requests_logs_id_prompt_length_and_params(configured):
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "temperature": 0}
    r = post(configured, "/v1/completions", body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"]
    lines = [line for line in configured.log.read_text().splitlines() if f"request {request_id}-0:" in line]
    assert len(lines) == 1, configured.log_tail()
    assert "INFO ember.engine.async_engine: request " + request_id + "-0: 5 prompt tokens, SamplingParams(" \
        in lines[0]
    assert "max_tokens=3" in lines[0] and "temperature=0" in lines[0]


def test_runner_task_and_pooler_config_flags_reach_the_engine_args(tmp_path):
    assert engine_args(parse_args(["serve"]))["runner"] == "auto"  # generate, or pooling for an encoder
    assert engine_args(parse_args(["serve", "--task", "score"]))["runner"] == "pooling"
    assert engine_args(parse_args(["serve", "--runner", "pooling"]))["runner"] == "pooling"
    assert engine_args(parse_args(["serve", "--task", "embed"]))["runner"] == "pooling"  # vLLM's older name
    args = engine_args(parse_args(["serve", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}']))
    assert args["pooler_config"] == '{"pooling_type": "MEAN"}'
    with pytest.raises(ValueError, match="--task embed means --runner pooling, but --runner generate is given"):
        engine_args(parse_args(["serve", "--task", "embed", "--runner", "generate"]))
    config = tmp_path / "embed.yaml"
    config.write_text("runner: pooling\npooler-config: {pooling_type: CLS, normalize: false}\n")
    from ember.config import EngineConfig
    from ember.pooling import PoolerConfig

    engine = EngineConfig(**engine_args(parse_args(["serve", "--config", str(config)])))
    assert (engine.runner, engine.pooler_config) == ("pooling", PoolerConfig("CLS", normalize=False))
