"""vLLM's and SGLang's `serve` flags that have no engine field of their own, so their launch
lines start `ember serve` unedited: each is honoured, accepted as a no-op with one log line
that says why, or refused with a message that names it and says what ember does instead.
(SGLang's names for ember's own flags, `--tp-size`, `--context-length`, ..., are option
strings of those flags: config.py, engine_args.py.)"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ember.server.limits import MAX_LOGPROBS

logger = logging.getLogger("ember.server")

API_KEY_VARIABLES = ("EMBER_API_KEY", "VLLM_API_KEY")  # read, in this order, when no --api-key is given
PROFILER_DIR_VARIABLES = ("EMBER_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")  # without --profiler-dir
_TOKENIZER_MODES = ("auto", "hf", "slow", "mistral", "custom")
_CONTENT_FORMATS = ("auto", "string", "openai")


def check_api_server_count(count: int, *, data_parallel_size: int = 1, core_process: bool = True,
                           executor_backend: str | None = None) -> None:
    """ValueError, naming the fix, for an API server count this server cannot run."""
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {count}")
    if count == 1:
        return
    if data_parallel_size != 1:
        raise ValueError("--api-server-count with --data-parallel-size is not supported: each data-parallel replica "
                         "runs one API process behind the router; give one of the two flags")
    if not core_process:
        raise ValueError("--api-server-count N runs N API processes in front of one engine core process: drop "
                         "--no-core-process")
    if executor_backend == "ray":
        raise ValueError("--api-server-count with --distributed-executor-backend ray is not supported: use the mp "
                         "backend, or one API server")
    if not hasattr(os, "pidfd_open"):
        raise ValueError("--api-server-count N needs Linux (the core watches its API processes with pidfd_open): "
                         "run one API server")


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is expected, got {value!r}")
    return parsed


def add_launch_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--api-key", dest="api_keys", nargs="+", action="extend", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (any of the keys given; repeatable) on every route "
                            "but /health, /version and the OpenAPI docs (and /metrics with --metrics-public); "
                            f"default: {' or '.join(API_KEY_VARIABLES)} from the environment, else no key")
    serve.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=None, metavar="NAME",
                       help="the model names clients may pass (the first is the one responses carry; default: "
                            "the MODEL argument as given)")
    serve.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves the app under (ASGI root_path)")
    serve.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file (with --ssl-certfile)")
    serve.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file (with --ssl-keyfile)")
    serve.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates that client certificates need")
    serve.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line in the log")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every streamed response ends with a usage chunk, as if stream_options.include_usage")
    serve.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                       help=f"the most logprobs / top_logprobs / prompt_logprobs a request may ask (at most "
                            f"{MAX_LOGPROBS})")
    serve.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                       help="chat-template variables every chat request gets (a request's chat_template_kwargs "
                            "override them), e.g. '{\"enable_thinking\": false}'")
    serve.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
                       help="SGLang's name for --no-enable-prefix-caching")
    # accepted as ember's behaviour (a no-op, logged), or refused where the value asks another
    serve.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="vLLM's: always on in ember (prefills are chunked by --max-num-batched-tokens)")
    serve.add_argument("--trust-remote-code", action="store_true",
                       help="vLLM's and SGLang's: ember runs no code from a model repository")
    serve.add_argument("--max-log-len", type=int, default=None,
                       help="vLLM's: ember's request log prints prompt lengths, never their text")
    serve.add_argument("--tokenizer-mode", default="auto", choices=_TOKENIZER_MODES,
                       help="vLLM's: auto, hf and slow are ember's tokenizer (HF tokenizers, from the model); "
                            "mistral and custom are refused")
    serve.add_argument("--chat-template-content-format", default="auto", choices=_CONTENT_FORMATS,
                       help="vLLM's: auto and string are ember's (a message's text parts joined into one string "
                            "for the template; a message with images keeps its parts, each image as {'type': "
                            "'image'}); openai is refused")
    serve.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                       help="vLLM's: refused unless {} (ember reads config.json as it is)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name their tokens 'token_id:ID' (a request's return_tokens_as_token_ids "
                            "overrides it)")
    serve.add_argument("--profiler-dir", default=None, metavar="DIR",
                       help="POST /start_profile and /stop_profile record the torch profiler on the engine core and "
                            f"write its traces here (default: {' or '.join(PROFILER_DIR_VARIABLES)} from the "
                            "environment, else profiling is off)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="a chat request may bring its own chat_template (Jinja, run sandboxed)")


@dataclass(frozen=True)
class LaunchSettings:
    """What the flags above set for `run_server`."""

    api_keys: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()
    uvicorn: dict[str, Any] = field(default_factory=dict)  # root_path, ssl_*
    force_include_usage: bool = False
    max_logprobs: int = MAX_LOGPROBS
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    log_stats: bool = True
    return_tokens_as_token_ids: bool = False
    trust_request_chat_template: bool = False
    profiler_dir: str | None = None


def launch_settings(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> LaunchSettings:
    """The settings of a parsed `serve` command line; ValueError names a refused flag. The
    accepted no-ops log one line each."""
    environ = os.environ if environ is None else environ
    if ns.enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill: ember always chunks prefills; to prefill a prompt in one "
                         "step, raise --max-num-batched-tokens to its length")
    if ns.tokenizer_mode in ("mistral", "custom"):
        raise ValueError(f"--tokenizer-mode {ns.tokenizer_mode} is not supported: ember uses the model's HF "
                         "tokenizer (tokenizer.json, or the GGUF's vocabulary); drop the flag")
    if ns.chat_template_content_format == "openai":
        raise ValueError("--chat-template-content-format openai is not supported: ember hands the template each "
                         "message's text as one string (the 'string' format)")
    if ns.hf_overrides:
        raise ValueError(f"--hf-overrides {json.dumps(ns.hf_overrides)} is not supported: ember reads the model's "
                         "config.json as it is; edit a copy of the model directory instead")
    if not 0 <= ns.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (OpenAI's top_logprobs limit); got "
                         f"{ns.max_logprobs}")
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    notes = {"enable_chunked_prefill": "--enable-chunked-prefill: always on in ember",
             "trust_remote_code": "--trust-remote-code: ember runs no code from a model repository, only its own "
                                  "implementation of the architecture (an unknown one is refused by name)",
             "max_log_len": "--max-log-len: ember's request log prints prompt lengths, never their text"}
    for name, note in notes.items():
        if getattr(ns, name) not in (None, False):
            logger.info("%s: accepted, nothing to do", note)
    if ns.tokenizer_mode in ("hf", "slow"):
        logger.info("--tokenizer-mode %s: accepted, ember's tokenizer is the model's HF one", ns.tokenizer_mode)
    keys = tuple(ns.api_keys or ())
    if not keys:
        keys = next(((environ[v],) for v in API_KEY_VARIABLES if environ.get(v)), ())
    if any(not k for k in keys):
        raise ValueError("--api-key: an empty key would let anyone in: give a non-empty one")
    uvicorn = {k: v for k, v in (("root_path", ns.root_path), ("ssl_keyfile", ns.ssl_keyfile),
                                 ("ssl_certfile", ns.ssl_certfile), ("ssl_ca_certs", ns.ssl_ca_certs)) if v}
    from ember.server.protocol import RESERVED_TEMPLATE_KWARGS  # pydantic: at serve time only

    reserved = sorted(RESERVED_TEMPLATE_KWARGS & (ns.default_chat_template_kwargs or {}).keys())
    if reserved:
        raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(reserved)}: ember passes them from "
                         "each request")
    return LaunchSettings(keys, tuple(ns.served_model_names or ()), uvicorn, ns.enable_force_include_usage,
                          ns.max_logprobs, dict(ns.default_chat_template_kwargs or {}), not ns.disable_log_stats,
                          ns.return_tokens_as_token_ids, ns.trust_request_chat_template,
                          ns.profiler_dir or next((environ[v] for v in PROFILER_DIR_VARIABLES if environ.get(v)), None))
