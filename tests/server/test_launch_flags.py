"""vLLM's and SGLang's launch lines on `ember serve` (server/launch_flags.py, the flags'
aliases in config.py): each flag honoured, accepted as a no-op, or refused naming itself;
then one real server over HTTPS with several names and keys, a root path, forced usage,
a lower logprobs cap and default chat-template variables."""

from __future__ import annotations

import json
import ssl
import subprocess
import time

import pytest
from servers import FRANCE, KEY, MODEL, Server

from ember.engine_args import engine_args
from ember.server.cli import parse_args
from ember.server.launch_flags import launch_settings

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def settings(line: str, environ: dict | None = None):
    ns = parse_args(line.split())
    return ns, engine_args(ns), launch_settings(ns, environ or {})


# (launch line, the engine fields it sets) from the peers' docs' recipes
LINES = [
    ("serve m --tensor-parallel-size 1 --max-model-len 4096 --gpu-memory-utilization 0.85 --enable-chunked-prefill "
     "--max-num-batched-tokens 8192 --max-num-seqs 128 --trust-remote-code --disable-log-stats --max-logprobs 5",
     dict(model="m", tensor_parallel_size=1, max_model_len=4096, gpu_memory_utilization=0.85,
          max_num_batched_tokens=8192, max_num_seqs=128)),
    ("serve --model-path m --tp-size 2 --mem-fraction-static 0.8 --context-length 2048 --max-running-requests 64 "
     "--chunked-prefill-size 1024 --random-seed 3 --grammar-backend llguidance --schedule-policy lpm "
     "--disable-cuda-graph --disable-radix-cache --dp-size 1 --log-level warning",
     dict(model="m", tensor_parallel_size=2, gpu_memory_utilization=0.8, max_model_len=2048, max_num_seqs=64,
          max_num_batched_tokens=1024, seed=3, structured_outputs_backend="llguidance", scheduling_policy="lpm",
          enforce_eager=True, enable_prefix_caching=False)),
    ("serve m --tp 2 --tokenizer-mode auto --max-log-len 100 --chat-template-content-format string "
     "--hf-overrides {} --return-tokens-as-token-ids --trust-request-chat-template", dict(tensor_parallel_size=2)),
]


@pytest.mark.parametrize("line,fields", LINES, ids=["vllm", "sglang", "more"])
def test_the_peers_launch_lines_parse_to_ember_settings(line, fields):
    ns, args, launch = settings(line)
    assert {k: args[k] for k in fields} == fields
    if "--log-level warning" in line:
        assert ns.uvicorn_log_level == "warning" and ns.data_parallel_size == 1
    if "--disable-log-stats" in line:
        assert launch.log_stats is False and ns.max_logprobs == 5
    assert (launch.return_tokens_as_token_ids, launch.trust_request_chat_template) == \
        (("--trust-request-chat-template" in line,) * 2)


@pytest.mark.parametrize("flag,says", [
    ("--no-enable-chunked-prefill", "always chunks prefills"),
    ("--tokenizer-mode mistral", "--tokenizer-mode mistral is not supported"),
    ("--chat-template-content-format openai", "content-format openai is not supported"),
    ('--hf-overrides {"num_hidden_layers":2}', "--hf-overrides"),
    ("--ssl-keyfile k.pem", "both --ssl-keyfile and --ssl-certfile"),
    ('--default-chat-template-kwargs {"tools":[]}', "may not set tools"),
    ("--max-logprobs 21", r"--max-logprobs must be in \[0, 20\]"),
])
def test_a_flag_ember_does_not_do_is_refused_by_name(flag, says):
    with pytest.raises(ValueError, match=says):
        settings(f"serve m {flag}")


def test_auto_tool_choice_is_on_by_default_and_its_parser_read_off_the_template():
    from ember.parsers import infer_tool_parser
    from ember.server.cli import _auto_tool_parser
    from ember.server.tool_calls import auto_tool_parser

    assert [_auto_tool_parser(parse_args(f"serve m {flags}".split())) for flags in
            ("", "--enable-auto-tool-choice", "--tool-call-parser mistral", "--no-auto-tool-choice",
             "--no-enable-auto-tool-choice")] == [None, None, "mistral", "", ""]
    with pytest.raises(ValueError, match="give one of the two"):
        _auto_tool_parser(parse_args("serve m --no-auto-tool-choice --tool-call-parser hermes".split()))
    templates = {"{{ '[TOOL_CALLS]' }}": "mistral", "<|python_tag|>{{ x }}": "llama3_json",
                 "[func_name1(params_name1=params_value1)]": "pythonic", "<tool_call>\n": "hermes",
                 "{{ messages }}": "hermes", None: "hermes"}
    assert {t: infer_tool_parser(t) for t in templates} == templates
    assert (auto_tool_parser(None, "<|python_tag|>"), auto_tool_parser("mistral", "<tool_call>"),
            auto_tool_parser("", "<tool_call>")) == ("llama3_json", "mistral", None)
    from ember.server.protocol import ChatCompletionRequest, InvalidRequest
    from ember.server.tool_calls import plan_tools

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(InvalidRequest, match="off on this server") as e:
        plan_tools(body, None)  # what --no-auto-tool-choice gives
    assert e.value.param == "tool_choice" and plan_tools(body, "hermes").parser is not None


def test_api_keys_repeat_and_come_from_the_environment():
    assert settings("serve m --api-key a b --api-key c")[2].api_keys == ("a", "b", "c")
    env = {"VLLM_API_KEY": "from-vllm", "EMBER_API_KEY": "from-ember"}
    assert settings("serve m", env)[2].api_keys == ("from-ember",)
    assert settings("serve m", {"VLLM_API_KEY": "v"})[2].api_keys == ("v",)
    assert settings("serve m --api-key flag", env)[2].api_keys == ("flag",)
    assert settings("serve m")[2].api_keys == ()
    assert settings("serve m --served-model-name a b")[2].served_model_names == ("a", "b")


def test_sglang_and_vllm_names_work_in_a_config_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model-path: m\ncontext-length: 512\ntp-size: 2\nenable-chunked-prefill: true\n"
                    "disable-radix-cache: true\nserved-model-name: [a, b]\n")
    ns, args, launch = settings(f"serve --config {path}")
    assert (args["model"], args["max_model_len"], args["tensor_parallel_size"], args["enable_prefix_caching"]) == \
        ("m", 512, 2, False)
    assert launch.served_model_names == ("a", "b")


@pytest.fixture(scope="module")
def tls_server(gguf_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    key, cert, template = folder / "key.pem", folder / "cert.pem", folder / "template.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{{ greeting | default('') }}<|im_start|>assistant\n")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    s = Server(gguf_path, folder / "server.log", "--served-model-name", MODEL, "other-name", "--api-key", KEY,
               "second-key", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/behind/proxy",
               "--enable-force-include-usage", "--max-logprobs", "2", "--disable-log-stats",
               "--chat-template", str(template),
               "--default-chat-template-kwargs", json.dumps({"greeting": "Bonjour tout le monde, vraiment"}))
    s.url = f"https://127.0.0.1:{s.port}"
    http = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60)
    deadline = time.monotonic() + 300
    while True:
        assert s.proc.poll() is None, s.log_tail()
        try:
            if http.get(f"{s.url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, s.log_tail()
        time.sleep(0.3)
    try:
        yield s, http
    finally:
        assert s.stop() == 0, s.log_tail()


def test_one_server_takes_the_flags_as_vllm_does(tls_server):
    s, http = tls_server
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="second-key", http_client=http, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", http_client=http, max_retries=0).models.list()
    assert client.completions.create(model="other-name", prompt=FRANCE, max_tokens=1, temperature=0).model == \
        "other-name"
    # --enable-force-include-usage: a stream without stream_options still ends with the usage
    chunks = list(client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=3, temperature=0, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    # --max-logprobs 2
    assert client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1, logprobs=2).choices[0].logprobs
    with pytest.raises(openai.BadRequestError, match=r"logprobs must be in \[0, 2\] \(--max-logprobs\); got 3"):
        client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1, logprobs=3)
    # --root-path: the app knows the prefix a proxy serves it under
    spec = http.get(f"{s.url}/openapi.json").json()
    assert spec["servers"] == [{"url": "/behind/proxy"}]


def test_default_chat_template_kwargs_reach_the_template_and_a_request_overrides_them(tls_server):
    s, http = tls_server
    headers = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Hi"}]

    def prompt_tokens(**extra) -> int:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, **extra}
        r = http.post(f"{s.url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    tokenized = http.post(f"{s.url}/tokenize", json={"model": MODEL, "messages": messages}, headers=headers)
    plain = prompt_tokens(chat_template_kwargs={"greeting": ""})
    assert prompt_tokens() == tokenized.json()["count"] > plain + 3  # the greeting's tokens, by default
