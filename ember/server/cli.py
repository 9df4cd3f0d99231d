"""The `ember` command: generate, chat, serve, bench, tune."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ember.config import EngineConfig
from ember.engine_args import add_engine_args, engine_args

if TYPE_CHECKING:
    from ember.engine.core_client import StartedCore
    from ember.server.launch_flags import LaunchSettings


def _json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form: '["http://a.example", "http://b.example"]'), or one string."""
    if not value.lstrip().startswith("["):
        return [value]
    items = json.loads(value)
    if not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return items


_SAMPLING_FLAGS = ("temperature", "top_p", "top_k")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Unset sampling flags take the model's generation_config.json defaults, else greedy."""
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="default: the model's, else 0 (greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1")
    parser.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0 (off)")


def sampling_params(ns: argparse.Namespace, defaults: Mapping[str, float | int]):
    """The flags given, else `defaults` (the model's), else greedy decoding."""
    from ember.sampling_params import SamplingParams

    given = {name: getattr(ns, name) for name in _SAMPLING_FLAGS if getattr(ns, name) is not None}
    fields = {"temperature": 0.0} | dict(defaults) | given
    return SamplingParams(max_tokens=ns.max_tokens, seed=ns.seed if fields["temperature"] > 0 else None, **fields)


def _stream(llm, prompt, params) -> tuple[str, int, float]:
    """Print a completion as it comes; return its text, token count and tokens/s."""
    start, first, shown, out = time.perf_counter(), None, 0, None
    for out in llm.stream(prompt, params):
        first = first or time.perf_counter()
        text = out.outputs[0].text
        print(text[shown:], end="", flush=True)
        shown = len(text)
    print()
    elapsed = time.perf_counter() - start
    n = len(out.outputs[0].token_ids)
    return out.outputs[0].text, n, n / elapsed if elapsed > 0 else 0.0


def cmd_generate(ns: argparse.Namespace) -> None:
    from ember import LLM

    llm = LLM(**engine_args(ns))
    _, n, rate = _stream(llm, ns.prompt, sampling_params(ns, llm.config.sampling_defaults))
    print(f"[{n} tokens, {rate:.1f} tok/s]", file=sys.stderr)


def cmd_chat(ns: argparse.Namespace) -> None:
    from ember import LLM

    llm = LLM(**engine_args(ns))
    tok = llm.get_tokenizer()
    params = sampling_params(ns, llm.config.sampling_defaults)
    messages: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []

    def answer(user: str) -> None:
        messages.append({"role": "user", "content": user})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        reply, n, rate = _stream(llm, {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                                 params)
        messages.append({"role": "assistant", "content": reply})
        print(f"[{n} tokens, {rate:.1f} tok/s]", file=sys.stderr)

    if ns.message is not None:  # one-shot
        answer(ns.message)
        return
    print("ember chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        answer(user)


def cmd_serve(ns: argparse.Namespace) -> None:
    from ember.server.launch_flags import check_api_server_count, launch_settings

    logging.getLogger("ember").setLevel(logging.INFO)
    launch = launch_settings(ns)  # a refused flag fails here, before a model loads
    check_api_server_count(ns.api_server_count, data_parallel_size=ns.data_parallel_size,
                           core_process=not ns.no_core_process, executor_backend=ns.distributed_executor_backend)
    if ns.data_parallel_size != 1:
        if launch.uvicorn:
            raise ValueError(f"--{next(iter(launch.uvicorn)).replace('_', '-')} is for one server: with "
                             "--data-parallel-size the router is what clients reach; put TLS or a path prefix in "
                             "front of it")
        sys.exit(_serve_data_parallel(ns))
    engine_config = EngineConfig(**engine_args(ns), usage_context="serve")
    started_core = None
    if ns.api_server_count == 1 and not ns.no_core_process:
        from ember.engine.core_client import start_core_process

        engine_config = engine_config.resolve()  # a bad model path or flag fails here, before a process starts
        # the core loads the model while this process imports the web stack (~1-2 s of a start)
        started_core = start_core_process(engine_config)
        logging.getLogger("ember.server").info("the engine core starts in process %d", started_core.process.pid)
    try:
        code = _run_server(ns, launch, engine_config, started_core)
    finally:
        if started_core is not None:
            started_core.stop()  # stopped already unless the server failed before it took the core
    sys.exit(code)


def _run_server(ns: argparse.Namespace, launch: LaunchSettings, engine_config: EngineConfig,
                started_core: StartedCore | None) -> int:
    from ember.server.limits import RequestLimits
    from ember.server.openai_api import run_server
    from ember.server.serving import CORSOptions

    limits = RequestLimits(max_n=ns.max_n, max_prompts=ns.max_prompts_per_request, max_logit_bias=ns.max_logit_bias,
                           max_stop=ns.max_stop_strings, max_choices=ns.max_choices,
                           max_body_bytes=ns.max_request_body_bytes, max_logprobs=ns.max_logprobs)
    cors = None
    if ns.allowed_origins is not None:
        cors = CORSOptions(tuple(ns.allowed_origins), tuple(ns.allowed_methods), tuple(ns.allowed_headers),
                           ns.allow_credentials)
    return run_server(engine_config, host=ns.host, port=ns.port,
                      api_keys=launch.api_keys, served_model_names=launch.served_model_names,
                      max_waiting_requests=ns.max_waiting_requests, shutdown_timeout=ns.shutdown_timeout,
                      log_level=ns.uvicorn_log_level, limits=limits, metrics_public=ns.metrics_public,
                      cors=cors, log_requests=ns.enable_log_requests,
                      tool_call_parser=_auto_tool_parser(ns), reasoning_parser=ns.reasoning_parser,
                      core_process=not ns.no_core_process, uvicorn_options=launch.uvicorn,
                      force_include_usage=launch.force_include_usage,
                      default_chat_template_kwargs=launch.default_chat_template_kwargs, log_stats=launch.log_stats,
                      return_tokens_as_token_ids=launch.return_tokens_as_token_ids,
                      trust_request_chat_template=launch.trust_request_chat_template,
                      profiler_dir=launch.profiler_dir, api_server_count=ns.api_server_count,
                      started_core=started_core)


def _serve_data_parallel(ns: argparse.Namespace) -> int:
    from ember.server.data_parallel import run_data_parallel
    from ember.server.ray_replicas import run_ray_replicas

    if ns.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
    _auto_tool_parser(ns)  # the replicas' flag errors, found before any starts
    device = ns.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if ns.data_parallel_backend == "ray":
        return run_ray_replicas(ns.argv, ns.data_parallel_size, device, ns.tensor_parallel_size, ns.host, ns.port,
                                ns.uvicorn_log_level)
    return run_data_parallel(ns.argv, ns.data_parallel_size, device, ns.host, ns.port, ns.uvicorn_log_level,
                             ns.tensor_parallel_size)


def _auto_tool_parser(ns: argparse.Namespace) -> str | None:
    """The parser of tool_choice "auto" outputs: --tool-call-parser, "" with --no-auto-tool-choice
    ("auto" refused), None to read it off the chat template (infer_tool_parser)."""
    if ns.enable_auto_tool_choice is False:
        if ns.tool_call_parser is not None:
            raise ValueError("--tool-call-parser reads tool_choice \"auto\" answers, which --no-auto-tool-choice "
                             "refuses: give one of the two")
        return ""
    return ns.tool_call_parser


def cmd_router(ns: argparse.Namespace) -> None:
    from ember.router.cli import run_router_from_args

    logging.getLogger("ember").setLevel(logging.INFO)
    run_router_from_args(ns)


def cmd_bench_throughput(ns: argparse.Namespace) -> None:
    from ember.bench.throughput import run_throughput

    run_throughput(ns, engine_args(ns))


def cmd_bench_serve(ns: argparse.Namespace) -> None:
    from ember.bench.serve import run_serve_bench

    run_serve_bench(ns)


def cmd_bench_frontend(ns: argparse.Namespace) -> None:
    from ember.bench.frontend import run_frontend_bench

    run_frontend_bench(ns, engine_args(ns))


def cmd_tune(ns: argparse.Namespace) -> None:
    from ember.bench.tune import run_tune

    if run_tune(ns)["best"] is None:
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    import ember

    parser = argparse.ArgumentParser(prog="ember", description="ember: a small LLM inference engine")
    parser.add_argument("--version", action="version", version=ember.__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print it as it comes")
    gen.add_argument("prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive, or one message with -m)")
    chat.add_argument("-m", "--message", default=None, help="answer this one message and exit")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-parallel-size", "--dp-size", "--dp", type=int, default=1,
                       help="N replicas of this server (each its own process: cores / N threads on the CPU, one "
                            "GPU each on CUDA) behind ember's cache-aware router on --host/--port")
    serve.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="N API processes (HTTP, tokenizing, detokenizing, SSE) in front of the one engine core "
                            "process, sharing --host/--port: for when one API process is what limits many streams")
    serve.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                       help="mp: the replicas are processes on this machine; ray: Ray actors spread over the nodes "
                            "of the cluster RAY_ADDRESS names (else a new local one), one bundle each "
                            "(OMP_NUM_THREADS or cores / N CPUs; tensor-parallel-size GPUs on CUDA)")
    from ember.server.launch_flags import add_launch_flags

    add_launch_flags(serve)  # the API keys, model names, TLS, and vLLM's and SGLang's flags
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="at most this many requests wait: one more gets 503 + Retry-After (default: no limit)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM; then they get an error")
    from ember.server.limits import RequestLimits

    caps = RequestLimits()
    serve.add_argument("--max-n", type=int, default=caps.max_n, help="the largest n (samples a prompt)")
    serve.add_argument("--max-prompts-per-request", type=int, default=caps.max_prompts,
                       help="prompts one completions request may carry")
    serve.add_argument("--max-logit-bias", type=int, default=caps.max_logit_bias, help="logit_bias entries")
    serve.add_argument("--max-stop-strings", type=int, default=caps.max_stop, help="stop strings a request")
    serve.add_argument("--max-choices", type=int, default=caps.max_choices,
                       help="options of a guided_choice / structured_outputs.choice")
    serve.add_argument("--max-request-body-bytes", type=int, default=caps.max_body_bytes,
                       help="larger request bodies get 413")
    from ember.parsers import TOOL_PARSERS

    serve.add_argument("--enable-auto-tool-choice", "--auto-tool-choice", action=argparse.BooleanOptionalAction,
                       default=None,
                       help='tool_choice "auto" (the default with tools): the model may call tools, read from its '
                            "text by the --tool-call-parser; on by default (--no-auto-tool-choice refuses it)")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the model's tool call format: hermes (Qwen2.5, Qwen3, Hermes), llama3_json, mistral, "
                            "pythonic (Llama 3.2 / 4), deepseek_v31, kimi_k2, qwen3_coder, glm45, openai (gpt-oss); "
                            "default: read off the chat template (a call marker it writes; hermes where it writes "
                            "none)")
    from ember.parsers.reasoning import REASONING_PARSERS

    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="the text between <think> and </think> goes to message.reasoning_content: qwen3, "
                            "deepseek_r1")
    serve.add_argument("--uvicorn-log-level", "--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.add_argument("--no-core-process", action="store_true",
                       help="run the engine core on a thread of the API server's process (one process) instead "
                            "of its own process: scheduling and the model's launches then share the "
                            "interpreter with HTTP, tokenizing and streaming")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's id, prompt length and sampling parameters (INFO)")
    serve.add_argument("--allowed-origins", type=_json_list, default=None,
                       help='CORS: the origins browsers may call from, a JSON list (\'["https://a.example"]\') '
                            'or one origin; "*" for any (default: no CORS headers: browsers refuse other origins)')
    serve.add_argument("--allowed-methods", type=_json_list, default=["*"],
                       help="CORS: the methods allowed, a JSON list (with --allowed-origins)")
    serve.add_argument("--allowed-headers", type=_json_list, default=["*"],
                       help="CORS: the request headers allowed, a JSON list (with --allowed-origins)")
    serve.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow cookies and Authorization headers (with --allowed-origins)")
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="a cache-aware router in front of several `ember serve` workers")
    from ember.router.cli import add_router_args

    add_router_args(router)
    router.set_defaults(func=cmd_router)

    bench = sub.add_parser("bench", help="benchmarks, as `vllm bench`")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser("throughput", help="offline throughput on random prompts")
    add_engine_args(throughput)
    from ember.bench.throughput import add_throughput_args

    add_throughput_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)
    serve_bench = bench_sub.add_parser("serve", help="online serving latency and throughput against any "
                                       "OpenAI-compatible server (ember, llama-server, vLLM)")
    from ember.bench.serve import add_serve_bench_args

    add_serve_bench_args(serve_bench)
    serve_bench.set_defaults(func=cmd_bench_serve)
    frontend_bench = bench_sub.add_parser("frontend", help="ember.lang's programs in-process, over HTTP and as "
                                          "one-by-one openai client calls (issue #41's four programs)")
    add_engine_args(frontend_bench)
    from ember.bench.frontend import add_frontend_bench_args

    add_frontend_bench_args(frontend_bench)
    frontend_bench.set_defaults(func=cmd_bench_frontend)

    tune = sub.add_parser("tune", help="the serving config with the highest request rate within latency SLOs: "
                          "sweeps, plots, a --config file")
    add_engine_args(tune)
    from ember.bench.tune import add_tune_args

    add_tune_args(tune)
    tune.set_defaults(func=cmd_tune)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a --config file's values under the flags given."""
    from ember.server.config_file import apply_config_file

    parser = build_parser()
    ns = parser.parse_args(argv)
    from_file = {}
    if getattr(ns, "config", None):  # the file's values become defaults: parse again so the flags win
        from_file = apply_config_file(ns.config_parser, ns.config)
        ns = parser.parse_args(argv)
        if ns.model_flag is not None and ns.model == from_file.get("model"):
            ns.model = None  # --model on the command line overrides the file's model
    vars(ns).pop("config_parser", None)  # the subcommand's parser, for the file: not a setting
    ns.from_config_file = {k: v for k, v in from_file.items() if getattr(ns, k, None) == v}  # not overridden
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    ns.argv = list(argv) if argv is not None else sys.argv[1:]  # --data-parallel-size passes it to the replicas
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        ns.func(ns)
    except (ValueError, RuntimeError) as e:
        print(f"ember: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
