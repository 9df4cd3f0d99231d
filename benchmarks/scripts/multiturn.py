"""Multi-turn conversations against a small KV pool, with and without a host-memory tier (issue #40):
`vllm serve` without and with `--kv-offloading-size`, then `ember serve` without and with
`--kv-offload-gib`, one after the other in one device call (serve_race.py's `serving`: start,
/health, --deadline, stop), each at its defaults plus the pool limit and the tier, driven by one
client (ember.bench.serve's streaming `send_request`):

    python3 benchmarks/scripts/multiturn.py MODEL_DIR --out DIR [--arms vllm,vllm-offload,ember,ember-tier]
        [--num-prompts 32] [--num-turns 6] [--shared-prefix-len 512] [--turn-input-len 1000]
        [--random-output-len 32] [--concurrency 4] [--pool-tokens 49152] [--tier-gib 32]
        [--max-model-len 8192] [--ember-block-size 128] [--load-format dummy] [--ember-flags ...] [--deadline S]

The workload: --num-prompts conversations share one system prompt of --shared-prefix-len random
token ids; each turn appends --turn-input-len new ids to the conversation's history (the system
prompt, its earlier turns and the model's answers as the token ids the server streamed back:
`return_token_ids`, which both servers honour on /v1/completions with a token-id prompt) and asks
for --random-output-len tokens (ignore_eos, greedy). Turns are interleaved: every conversation does
turn 1, then turn 2, ..., at most --concurrency requests at a time, so by the time a conversation
returns the pool has evicted its history: a returning turn's TTFT is what recomputing it (no tier)
or loading it back from host memory (tier) costs.

The bytes (the defaults, the Llama-3.1-8B shape in bf16): a token's KV is 32 layers x 8 KV heads x
128 dims x 2 (K, V) x 2 bytes = 128 KiB. A conversation ends at 512 + 6 x (1,000 + 32) = 6,704
tokens; the 32 of them hold 512 + 32 x 6 x 1,032 = 198,656 distinct tokens = 24.25 GiB of KV,
4.0x the pool of 49,152 tokens (6 GiB: ember's --num-kv-blocks 384 of 128 tokens, vLLM's
--num-gpu-blocks-override 3,072 of 16). The tier, 32 GiB, holds all of it (the device has 128 GiB
of RAM). The pool holds the 4 requests in flight at the last turn (26,816 tokens) with room to
spare. max_model_len 8,192 >= 6,704. At 1/8 the lengths on the CPU (the default model, 8 conversations
x 6 turns of 125 new ids, a 64-id system prompt, 4 out, a pool of 96 blocks of 16, one request at a
time) ember without the tier found 3,520 of the 24,552 prompt tokens in its prefix cache (the system
prompts: every history had been evicted), with the tier 18,368, 14,848 of them loaded from host memory.

Per arm one RESULT line (JSON): TTFT p50 / p99 of the returning turns (2 and later) and of the
first, requests completed and failed, the wall time, and the server's prefix-cache, tier and
preemption counters from /metrics (ember: prefix_cache_hits_total, kv_offload_hits_total,
kv_offload_bytes_total, kv_offload_load_seconds_count / _sum (steps that loaded, their copies'
seconds); vLLM: prefix_cache_hits_total, external_prefix_cache_hits_total (the
offloading connector's hits), kv_offload_load_bytes_total / store_bytes_total); all of them in
DIR/multiturn.json, then the ratios the goal names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import time
import urllib.request
from pathlib import Path

import numpy as np
from serve_race import serving

from ember.bench.results import RandomRequest
from ember.bench.serve import (
    RequestResult,
    add_workload_args,
    client_session,
    send_request,
    server_model,
    shared_prefix_requests,
)
from ember.loader.tokenizer_files import load_tokenizer

ARMS = ("vllm", "vllm-offload", "ember", "ember-tier")
COUNTERS = re.compile(r"^((?:vllm|ember):\w*(?:prefix_cache|offload|preemption)\w*_(?:total|count|sum))(\{[^}]*\})? (\S+)$",
                      re.M)


def arm_flags(arm: str, args: argparse.Namespace) -> list[str]:
    """The flags an arm adds to its server's defaults: the pool limit, and the tier."""
    if arm.startswith("vllm"):
        flags = ["--num-gpu-blocks-override", str(args.pool_tokens // 16)]  # vLLM's block: 16 tokens
        return flags + (["--kv-offloading-size", str(args.tier_gib), "--kv-offloading-backend", "native"]
                        if arm == "vllm-offload" else [])
    flags = ["--num-kv-blocks", str(args.pool_tokens // args.ember_block_size), *shlex.split(args.ember_flags)]
    # the plain arm turns the tier off: on CUDA it is on by default
    return flags + ["--kv-offload-gib", str(args.tier_gib) if arm == "ember-tier" else "0"]


async def converse(base_url: str, model: str, system: list[int], conversations: list[list[RandomRequest]],
                   concurrency: int) -> list[RequestResult]:
    """Every conversation's turn 1, then every one's turn 2, ...: each prompt the history so far
    (system prompt, earlier prompts, the answers' streamed token ids) and the turn's new ids."""
    url = base_url + "/v1/completions"
    histories = [list(system) for _ in conversations]
    limit = asyncio.Semaphore(concurrency)
    results: list[RequestResult] = []
    async with client_session() as client:
        async def one(c: int, turn: int) -> RequestResult:
            req = conversations[c][turn]
            prompt = histories[c] + req.prompt_token_ids
            payload = {"model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True, "stream": True,
                       "stream_options": {"include_usage": True}}
            async with limit:
                r = await send_request(client, url, payload, {}, len(prompt))
            if r.ok and len(r.token_ids) != req.output_len:
                raise ValueError(f"{base_url} streamed {len(r.token_ids)} token ids for {req.output_len} tokens: "
                                 "the client needs return_token_ids honoured on /v1/completions")
            r.turn, histories[c] = turn, prompt + r.token_ids
            return r

        for turn in range(len(conversations[0])):
            results += await asyncio.gather(*(one(c, turn) for c in range(len(conversations))))
    return results


def counters(base_url: str) -> dict[str, float]:
    """The server's prefix-cache, offload and preemption counters ({name{labels}: value}; the
    model and engine labels left out)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in COUNTERS.findall(text):
        kept = [x for x in (labels or "{}")[1:-1].split(",") if x and not x.startswith(("model_name=", "engine="))]
        key = name + (f"{{{','.join(kept)}}}" if kept else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(1000 * float(np.percentile(values, q)), 1) if values else None


def run_arm(arm: str, args: argparse.Namespace, system: list[int], conversations: list[list[RandomRequest]],
            deadline: float) -> dict | None:
    if deadline - time.monotonic() < 60:
        print(f"== {arm}: skipped, the call's time is spent", flush=True)
        return None
    server = "vllm" if arm.startswith("vllm") else "ember"
    flags = arm_flags(arm, args)
    common = ["--load-format", args.load_format, "--seed", "0"]
    log = args.out / f"multiturn_{arm}.server.log"
    with serving(server, args.model, args.port, flags, log, args.max_model_len, deadline, arm, common) as proc:
        if proc is None:
            return None
        base_url = f"http://127.0.0.1:{args.port}"
        left = deadline - time.monotonic()
        t0 = time.monotonic()
        try:
            results = asyncio.run(asyncio.wait_for(
                converse(base_url, server_model(base_url, None), system, conversations, args.concurrency), left - 5))
        except (TimeoutError, ValueError) as e:  # the next arm still runs
            print(f"== {arm}: {str(e) or 'the conversations ran past the call time'}", flush=True)
            return None
        wall = time.monotonic() - t0
        ok = [r for r in results if r.ok]
        returning, first = [r.ttft for r in ok if r.turn > 0], [r.ttft for r in ok if r.turn == 0]
        row = {"arm": arm, "flags": shlex.join(flags), "completed": len(ok), "failed": len(results) - len(ok),
               "errors": sorted({r.error for r in results if not r.ok})[:3], "wall_s": round(wall, 1),
               "ttft_p50_ms_returning": percentile_ms(returning, 50),
               "ttft_p99_ms_returning": percentile_ms(returning, 99),
               "ttft_p50_ms_first": percentile_ms(first, 50), "ttft_p99_ms_first": percentile_ms(first, 99),
               "prompt_tokens": sum(r.prompt_len for r in ok), "metrics": counters(base_url)}
        print("RESULT " + json.dumps(row), flush=True)
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    add_workload_args(ap)  # --num-prompts (conversations), --num-turns, --shared-prefix-len, --turn-input-len, ...
    ap.set_defaults(num_prompts=32, num_turns=6, shared_prefix_len=512, turn_input_len=1000, random_output_len=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--pool-tokens", type=int, default=49152, help="the KV pool of both servers, in tokens")
    ap.add_argument("--tier-gib", type=float, default=32.0, help="host memory: ember's tier, vLLM's offloading")
    ap.add_argument("--ember-block-size", type=int, default=128, help="ember's KV block (128 on CUDA, 16 on the CPU)")
    ap.add_argument("--max-model-len", type=int, default=8192, help="both servers'")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--ember-flags", default="", help="more flags for both ember arms")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--deadline", type=float, default=560, help="seconds from now by which every arm has ended")
    args = ap.parse_args()
    if unknown := set(args.arms.split(",")) - set(ARMS):
        ap.error(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    for name, unit in (("vLLM's", 16), ("ember's", args.ember_block_size)):
        if args.pool_tokens % unit:
            ap.error(f"--pool-tokens {args.pool_tokens} is not a whole number of {name} {unit}-token blocks")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline
    tok = load_tokenizer(args.model)
    system, conversations = shared_prefix_requests(args, tok.vocab_size, tok.all_special_ids)
    rows = [row for arm in args.arms.split(",") if (row := run_arm(arm, args, system, conversations, deadline))]
    (args.out / "multiturn.json").write_text(json.dumps(rows, indent=1))
    p50 = {r["arm"]: r["ttft_p50_ms_returning"] for r in rows}
    for num, den in (("ember-tier", "ember"), ("ember-tier", "vllm-offload"), ("vllm-offload", "vllm")):
        if p50.get(num) and p50.get(den):
            print(f"RATIO returning-turn TTFT p50 {num} / {den} = {p50[num] / p50[den]:.2f}", flush=True)


if __name__ == "__main__":
    main()
