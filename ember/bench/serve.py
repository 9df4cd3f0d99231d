"""`ember bench serve`: an async streaming client that measures any OpenAI-compatible
server (ember, llama.cpp's llama-server, vLLM) the way `vllm bench serve` does.

Per request: TTFT (send -> first streamed token), ITL (gaps between streamed chunks),
TPOT ((E2EL - TTFT) / (output tokens - 1)), E2EL (send -> last byte). Over the run:
request, output-token and total-token throughput over the benchmark's wall time.
Arrivals: all at once (`--request-rate inf`), or Poisson (`--burstiness 1`) / gamma
inter-arrival times, capped by `--max-concurrency`. Prompts are sent as token ids so
every server sees exactly the same prompt:

- `--dataset random`: vLLM's random dataset.
- `--dataset shared-prefix`: `--num-prompts` conversations, all at once, that share one
  system prompt of `--shared-prefix-len` random ids. Each runs `--num-turns` turns in
  sequence; turn k's prompt is the system prompt, every earlier user message and answer
  (the answer's text re-tokenized, as a chat client would send it), and a new user
  message of `--turn-input-len` ids. TTFT is also reported for the first turn alone and
  for the later ones, which a prefix cache can serve from the history. `--request-rate`
  spaces the conversations' starts.
- `--dataset FILE.jsonl`: one request a line, `{"prompt": "text" or [ids], "max_tokens": N}`
  (text is tokenized with `--tokenizer`).
- `--dataset images`: chat requests (to /v1/chat/completions) of one `--image-width` x
  `--image-height` image of random pixels then `--random-input-len` tokens of random text
  (ember/bench/image_requests.py); `--shared-image` sends the same image in every request.
  The servers' own prompt token counts (usage.prompt_tokens: text, template and image tokens)
  are reported beside the client's text-only count.

`--plot FILE.png` draws the run's TTFT and TPOT distributions (ember/bench/plots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ember.bench.image_requests import IMAGE_FORMATS, ChatRequest, image_requests
from ember.bench.results import RandomRequest
from ember.bench.throughput import machine_info, random_requests


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the streamed ones, where the request asked (return_token_ids)
    turn: int = 0  # in a conversation (shared-prefix dataset)
    output_len: int = 0
    server_prompt_len: int = 0  # the server's usage.prompt_tokens, where it reports one
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The sizes of the random and shared-prefix workloads (`ember bench serve`, `ember tune`)."""
    parser.add_argument("--num-prompts", type=int, default=16, help="requests, or conversations for shared-prefix")
    parser.add_argument("--shared-prefix-len", type=int, default=2048, help="shared-prefix: system prompt tokens")
    parser.add_argument("--num-turns", type=int, default=5, help="shared-prefix: turns per conversation")
    parser.add_argument("--turn-input-len", type=int, default=32, help="shared-prefix: tokens of each user message")
    parser.add_argument("--random-input-len", type=int, default=64)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--tokenizer", default=None,
                        help="a .gguf or HF dir whose vocabulary the random prompts use (default: ember's default model)")
    parser.add_argument("--dataset", default="random", metavar="random|shared-prefix|images|FILE.jsonl",
                        help='FILE.jsonl: one request a line, {"prompt": "text" or [token ids], "max_tokens": N}')
    add_workload_args(parser)
    parser.add_argument("--image-width", type=int, default=1024, help="images: each image's width in pixels")
    parser.add_argument("--image-height", type=int, default=768, help="images: each image's height in pixels")
    parser.add_argument("--image-format", default="jpeg", choices=sorted(IMAGE_FORMATS),
                        help="images: how the pixels are encoded in the data: URL")
    parser.add_argument("--shared-image", action="store_true", help="images: the same image in every request")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson arrivals; gamma shape otherwise")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request runs to max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--extra-body", default=None, help='JSON merged into each request, e.g. \'{"cache_prompt": false}\'')
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--label", default=None, help="a name for this run in the report")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="the TTFT and TPOT distributions (CDFs) of this run, as a PNG")


def client_session():
    """The client's HTTP session: aiohttp, whose streamed reads take 41 µs of CPU a chunk where
    httpx took 102 (256 paced streams, BENCHMARKS.md), so one client process keeps up with a
    GPU server's thousands of chunks a second; no connection limit, no timeout, lines up to 1 MiB."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None),
                                 read_bufsize=1 << 20)


async def send_request(session, url: str, payload: dict[str, Any], headers: dict[str, str], prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            chunks = 0
            async for raw in response.content:  # one line at a time
                line = raw.decode()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                body = json.loads(data)
                if body.get("usage"):
                    result.output_len = body["usage"].get("completion_tokens") or result.output_len
                    result.server_prompt_len = body["usage"].get("prompt_tokens") or result.server_prompt_len
                choice = (body.get("choices") or [{}])[0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                ids = choice.get("token_ids")
                if text or ids:
                    result.text += text or ""
                    result.token_ids += ids or []
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
            result.latency = time.perf_counter() - start
            result.output_len = result.output_len or chunks
            result.ok = chunks > 0
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


def _arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


async def _run(ns: argparse.Namespace, requests: list[RandomRequest] | list[ChatRequest],
               model: str) -> tuple[list[RequestResult], float]:
    """Token-id prompts to `--endpoint`, chat requests to /v1/chat/completions."""
    chat = bool(requests) and isinstance(requests[0], ChatRequest)
    url = ns.base_url.rstrip("/") + ("/v1/chat/completions" if chat else ns.endpoint)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    extra = json.loads(ns.extra_body) if ns.extra_body else {}
    limit = asyncio.Semaphore(ns.max_concurrency or len(requests))
    gaps = _arrival_gaps(len(requests), ns.request_rate, ns.burstiness, ns.seed)

    async with client_session() as client:
        async def one(req: RandomRequest | ChatRequest) -> RequestResult:
            prompt = {"messages": req.messages} if chat else {"prompt": req.prompt_token_ids}
            payload = {"model": model, **prompt, "max_tokens": req.output_len,
                       "temperature": ns.temperature, "stream": True, "stream_options": {"include_usage": True},
                       **({"ignore_eos": True} if ns.ignore_eos else {}), **extra}
            async with limit:
                return await send_request(client, url, payload, headers,
                                   req.prompt_len if chat else len(req.prompt_token_ids))

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def _run_conversations(ns: argparse.Namespace, conversations: list[list[RandomRequest]], system: list[int],
                             model: str, encode) -> tuple[list[RequestResult], float]:
    """Each conversation's turns in sequence, all conversations at once."""
    url = ns.base_url.rstrip("/") + ns.endpoint
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    extra = json.loads(ns.extra_body) if ns.extra_body else {}

    gaps = _arrival_gaps(len(conversations), ns.request_rate, ns.burstiness, ns.seed)

    async with client_session() as client:
        async def converse(turns: list[RandomRequest], delay: float) -> list[RequestResult]:
            await asyncio.sleep(delay)
            history, results = list(system), []
            for k, turn in enumerate(turns):
                prompt = history + turn.prompt_token_ids
                payload = {"model": model, "prompt": prompt, "max_tokens": turn.output_len,
                           "temperature": ns.temperature, "stream": True, "stream_options": {"include_usage": True},
                           **({"ignore_eos": True} if ns.ignore_eos else {}), **extra}
                result = await send_request(client, url, payload, headers, len(prompt))
                result.turn = k
                results.append(result)
                history = prompt + encode(result.text)
            return results

        start = time.perf_counter()
        starts = np.cumsum(gaps).tolist()
        per_conversation = await asyncio.gather(*(converse(c, t) for c, t in zip(conversations, starts)))
        return [r for rs in per_conversation for r in rs], time.perf_counter() - start


def shared_prefix_requests(ns: argparse.Namespace, vocab_size: int, special_ids) -> tuple[list[int], list[list[RandomRequest]]]:
    """The system prompt, and each conversation's user turns (ids, answer length)."""
    system = random_requests(1, ns.shared_prefix_len, 1, 0.0, vocab_size, special_ids, ns.seed)[0].prompt_token_ids
    turns = random_requests(ns.num_prompts * ns.num_turns, ns.turn_input_len, ns.random_output_len,
                            ns.random_range_ratio, vocab_size, special_ids, ns.seed + 1)
    return system, [turns[i * ns.num_turns:(i + 1) * ns.num_turns] for i in range(ns.num_prompts)]


def file_requests(path: str, encode) -> list[RandomRequest]:
    """`--dataset FILE.jsonl`: each line `{"prompt": "text" or [ids], "max_tokens": N}`."""
    requests = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt, max_tokens = item["prompt"], item["max_tokens"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {n}: expected {{\"prompt\": text or [ids], \"max_tokens\": N}}: {e}") from e
        ids = encode(prompt) if isinstance(prompt, str) else prompt
        if not ids or not all(isinstance(i, int) for i in ids) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path} line {n}: the prompt must be non-empty text or token ids, max_tokens >= 1")
        requests.append(RandomRequest(ids, max_tokens))
    if not requests:
        raise ValueError(f"{path} holds no request")
    return requests


def run_workload(ns: argparse.Namespace, tok, model: str,
                 timeout: float | None = None) -> tuple[list[RequestResult], float]:
    """Send `ns.dataset`'s requests to `ns.base_url`; the per-request results and the wall
    time (TimeoutError after `timeout` s)."""
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    if ns.dataset == "shared-prefix":
        system, conversations = shared_prefix_requests(ns, tok.vocab_size, tok.all_special_ids)
        return asyncio.run(asyncio.wait_for(_run_conversations(ns, conversations, system, model, encode), timeout))
    if ns.dataset == "images":
        requests = image_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.image_width,
                                  ns.image_height, tok, ns.seed, ns.shared_image, ns.image_format)
    elif ns.dataset == "random":
        requests = random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio,
                                   tok.vocab_size, tok.all_special_ids, ns.seed)
    elif Path(ns.dataset).is_file():
        requests = file_requests(ns.dataset, encode)
    else:
        raise ValueError(f"--dataset {ns.dataset!r}: give random, shared-prefix, images or an existing .jsonl file")
    return asyncio.run(asyncio.wait_for(_run(ns, requests, model), timeout))


def tpots(results: list[RequestResult]) -> list[float]:
    """Each successful request's time per output token after the first (s)."""
    return [(r.latency - r.ttft) / (r.output_len - 1) for r in results if r.ok and r.output_len > 1]


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def stats(name: str, values: list[float]) -> dict[str, float]:
        v = np.asarray(values or [0.0]) * ms
        return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
                f"std_{name}_ms": float(v.std()), f"p99_{name}_ms": float(np.percentile(v, 99))}

    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    by_turn = {}
    if any(r.turn for r in results):
        by_turn = {**{f"first_turn_{k}": v for k, v in stats("ttft", [r.ttft for r in ok if r.turn == 0]).items()},
                   **{f"later_turns_{k}": v for k, v in stats("ttft", [r.ttft for r in ok if r.turn > 0]).items()}}
    return {
        **by_turn,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "server_prompt_tokens": sum(r.server_prompt_len for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **stats("ttft", [r.ttft for r in ok]), **stats("tpot", tpots(ok)),
        **stats("itl", [x for r in ok for x in r.itl]), **stats("e2el", [r.latency for r in ok]),
    }


def format_summary(label: str, s: dict[str, Any]) -> str:
    def row(name: str, value: Any) -> str:
        return f"{name:<40}{value:>12.2f}" if isinstance(value, float) else f"{name:<40}{value:>12}"

    lines = [f"{' Serving Benchmark Result: ' + label + ' ':=^52}",
             row("Successful requests:", s["completed"]), row("Failed requests:", s["failed"]),
             row("Benchmark duration (s):", s["duration_s"]), row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]),
             row("Prompt tokens, the server's count:", s["server_prompt_tokens"]),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"]),
             row("Total Token throughput (tok/s):", s["total_token_throughput"])]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^52}")
        for stat in ("mean", "median", "p99"):
            lines.append(row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):",
                             s[f"{stat}_{key}_ms"]))
    if "first_turn_mean_ttft_ms" in s:
        lines.append(f"{'Time to First Token by turn':-^52}")
        lines.append(row("Mean TTFT, first turns (ms):", s["first_turn_mean_ttft_ms"]))
        lines.append(row("Mean TTFT, later turns (ms):", s["later_turns_mean_ttft_ms"]))
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    lines.append("=" * 52)
    return "\n".join(lines)


def server_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"]
    return models[0]["id"]


def run_serve_bench(ns: argparse.Namespace) -> dict[str, Any]:
    from ember.loader.tokenizer_files import load_tokenizer

    if ns.tokenizer is None:
        from ember.loader.default_model import fetch_default_model

        ns.tokenizer = str(fetch_default_model())
    tok = load_tokenizer(ns.tokenizer)
    if ns.plot:
        from ember.bench.plots import require_matplotlib

        require_matplotlib()
    model = ns.model or server_model(ns.base_url, ns.api_key)
    results, duration = run_workload(ns, tok, model)
    summary = summarize(results, duration)
    label = ns.label or f"{model} @ {ns.base_url}"
    report = {"config": {k: v for k, v in vars(ns).items() if k != "func"}, "label": label,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info("client"),
              "results": summary}
    if ns.plot:  # the plotted values go in the JSON too
        from ember.bench.plots import plot_latency_distribution

        ok = [r for r in results if r.ok]
        report["per_request"] = {"ttft_ms": [r.ttft * 1000 for r in ok], "tpot_ms": [t * 1000 for t in tpots(ok)]}
        plot_latency_distribution(report["per_request"]["ttft_ms"], report["per_request"]["tpot_ms"], ns.plot, label)
    print(format_summary(label, summary))
    if ns.output_json:
        Path(ns.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report
