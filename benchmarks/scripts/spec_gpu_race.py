"""Issue #38's race: speculative decoding against none, greedy, on the input-grounded prompts of
benchmarks/spec_ngram_prompts.json, for ember or vLLM 0.24 on the same model directory (h200.sh
spec-race: real SmolLM2-135M-Instruct weights in bf16, benchmarks/scripts/smol_stage.py), one
RESULT line (JSON) per engine, method and batch size:

    python3 benchmarks/scripts/spec_gpu_race.py --engine ember|vllm --model DIR_OR_GGUF
        [--methods ngram eagle3 draft_model] [--batch 1 32] [--max-tokens 256] [--k 4]
        [--lookup 2 4] [--vllm-method ngram] [--drafts-dir /tmp/spec-drafts] [--draft-layers 4]
        [--prompts N] [--repeats 2]

Methods (each in vLLM's speculative_config shape, the one JSON both engines take):
- ngram: prompt lookup, K drafts, prompt_lookup_min/max (--lookup). vLLM's `ngram` proposer runs
  on the CPU through numba (smol_stage.py stages its wheels); --vllm-method ngram_gpu is vLLM's GPU
  prompt lookup, for a device where numba will not import (the line's "method" says which ran).
- eagle3, draft_model: {"method", "model", "num_speculative_tokens"} on drafters written once from
  the target's directory into --drafts-dir (ember/bench/spec_drafts.py; kept where already there):
  a random EAGLE-3 head (seed 0, draft vocabulary 32,000, the target's default aux layers named in
  its config) and the target cut to its first --draft-layers layers. Both engines load the same
  files, so under greedy sampling they must keep the same drafts: outputs_sha256 and
  accepted_tokens (and accepted_per_position) of two engines' lines say whether they did.

Each arm (none, then each method) runs in its own process (a second vLLM engine in one process
cannot have the GPU memory the first holds) and measures every --batch size in turn, prefix cache
off, max_model_len 2048. Batch 1: for every prompt in turn a max_tokens=1 run, then the max_tokens
run. Batch N > 1: the first N prompts (the file cycled where it has fewer) in one llm.chat call,
max_tokens=1 then max_tokens. The first pass warms up, the last (of --repeats) is timed. tok/s is
output tokens over the full runs' time (end to end); decode tok/s is spec_ngram.py's: (output
tokens - one per request) / (time of the full runs - time of the max_tokens=1 runs). Acceptance
over the timed pass: ember's scheduler counters, vLLM's spec_decode counters (LLM.get_metrics,
stats on). same_tokens: the method's outputs are the none arm's, token for token; prompt_sha256
hashes every prompt's token ids, so two engines' lines say whether they were given the same prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "benchmarks" / "spec_ngram_prompts.json"
sys.path.insert(0, str(ROOT))  # ember, where PYTHONPATH does not name the tree
MAX_MODEL_LEN = 2048
METHODS = ("ngram", "eagle3", "draft_model")
VLLM_SPEC = "vllm:spec_decode_num_"  # its counters: ...drafts, ...draft_tokens, ...accepted_tokens
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"  # a Vector in get_metrics()


def spec_config(k: int, lookup: tuple[int, int], method: str = "ngram", model: str | Path | None = None
                ) -> dict[str, Any]:
    """vLLM's speculative_config: prompt lookup (ngram, ngram_gpu) or a drafter at `model`."""
    if method.startswith("ngram"):
        return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
                "prompt_lookup_max": lookup[1]}
    if model is None:
        raise ValueError(f"method {method!r} needs the drafter's directory (--drafts-dir)")
    return {"method": method, "model": str(model), "num_speculative_tokens": k}


def _open(engine: str, model: str, spec: dict[str, Any] | None) -> tuple[Any, Any]:
    """(the engine's LLM, its SamplingParams class)."""
    extra = {"speculative_config": spec} if spec else {}
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, tokenizer=model, enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN, seed=0,
                  gpu_memory_utilization=0.8, disable_log_stats=False, **extra)
        return llm, SamplingParams
    from ember import LLM, SamplingParams

    return LLM(model, enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN, **extra), SamplingParams


def _counters(engine: str, llm: Any) -> tuple[int, int, int, list[int]]:
    """(drafts, draft tokens, accepted tokens, accepted at each draft position) so far."""
    if engine == "vllm":
        got = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        per_position: list[int] = []
        for m in llm.get_metrics():
            what = m.name.removeprefix(VLLM_SPEC).removesuffix("_total")
            if m.name == VLLM_PER_POSITION:
                per_position = _added(per_position, list(m.values))
            elif m.name.startswith(VLLM_SPEC) and what in got:
                got[what] += int(m.value)
        return got["drafts"], got["draft_tokens"], got["accepted_tokens"], per_position
    spec = llm.engine.scheduler.spec
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_position)


def _added(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign * b, position by position (the shorter padded with zeros)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(n)]


def _groups(items: list[dict], batch: int) -> list[list[Any]]:
    """The conversations of each llm.chat call: one a call at batch 1, else the first `batch` (cycled)."""
    if batch == 1:
        return [[item["messages"]] for item in items]
    return [[items[i % len(items)]["messages"] for i in range(batch)]]


def measure(engine: str, llm: Any, sampling_params: Any, items: list[dict], max_tokens: int, repeats: int,
            batch: int) -> dict[str, Any]:
    """One batch size on an open engine (module docstring): times, tokens, counters, outputs."""
    params = sampling_params(temperature=0, max_tokens=max_tokens)
    first = sampling_params(temperature=0, max_tokens=1)
    for rep in range(repeats):
        timed = rep == repeats - 1
        if timed:
            before = _counters(engine, llm)
            seconds = prefill = 0.0
            outputs: list[list[int]] = []
            prompt_hash = hashlib.sha256()
        for conversations in _groups(items, batch):
            start = time.perf_counter()
            llm.chat(conversations, first, use_tqdm=False)
            to_first = time.perf_counter() - start
            start = time.perf_counter()
            outs = llm.chat(conversations, params, use_tqdm=False)
            took = time.perf_counter() - start
            if timed:
                seconds += took
                prefill += to_first
                for out in outs:
                    outputs.append(list(out.outputs[0].token_ids))
                    prompt_hash.update(json.dumps(list(out.prompt_token_ids)).encode())
    after = _counters(engine, llm)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:3], before[:3]))
    return {"batch": batch, "seconds": seconds, "prefill_seconds": prefill, "outputs": outputs, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "accepted_per_position": _added(after[3], before[3], -1), "prompt_sha256": prompt_hash.hexdigest()}


def run_arm(engine: str, model: str, spec: dict[str, Any] | None, items: list[dict], max_tokens: int,
            repeats: int = 2, batches: tuple[int, ...] = (1,)) -> list[dict[str, Any]]:
    """One arm of one engine, one engine opened for every batch size in turn: a measure() each."""
    llm, sampling_params = _open(engine, model, spec)
    method = spec["method"] if spec else "none"
    return [{"method": method, **measure(engine, llm, sampling_params, items, max_tokens, repeats, b)}
            for b in batches]


def arm_row(arm: dict[str, Any]) -> dict[str, Any]:
    """One arm's numbers: output tokens, seconds, tok/s end to end and after the first token, the
    outputs' hash and, where it drafted, acceptance."""
    tokens = sum(len(o) for o in arm["outputs"])
    decode = (tokens - len(arm["outputs"])) / (arm["seconds"] - arm["prefill_seconds"])
    row = {"output_tokens": tokens, "seconds": round(arm["seconds"], 3), "tok_per_s": round(tokens / arm["seconds"], 2),
           "decode_tok_per_s": round(decode, 2),
           "outputs_sha256": hashlib.sha256(json.dumps(arm["outputs"]).encode()).hexdigest()}
    if arm["drafts"]:
        row |= {"drafts": arm["drafts"], "draft_tokens": arm["draft_tokens"], "accepted_tokens": arm["accepted_tokens"],
                "accepted_per_position": arm["accepted_per_position"],
                "mean_accepted_length": round(1 + arm["accepted_tokens"] / arm["drafts"], 3),
                "acceptance_rate": round(arm["accepted_tokens"] / arm["draft_tokens"], 3),
                "acceptance_per_position": [round(n / arm["drafts"], 3) for n in arm["accepted_per_position"]]}
    return row


def arm_name(method: str) -> str:
    """The arm a method belongs to (vLLM's ngram_gpu is the ngram arm)."""
    return "ngram" if method.startswith("ngram") else method


def summary(engine: str, none: dict[str, Any], arm: dict[str, Any], k: int) -> dict[str, Any]:
    """The RESULT line of one engine, method and batch size from the none arm's and the method's."""
    name = arm_name(arm["method"])
    row: dict[str, Any] = {"engine": engine, "method": arm["method"], "batch": arm.get("batch", 1),
                           "prompts": len(none["outputs"]), "k": k, "prompt_sha256": none["prompt_sha256"],
                           "same_prompts": none["prompt_sha256"] == arm["prompt_sha256"],
                           "none": arm_row(none), name: arm_row(arm)}
    row["speedup"] = round(row[name]["tok_per_s"] / row["none"]["tok_per_s"], 3)
    row["decode_speedup"] = round(row[name]["decode_tok_per_s"] / row["none"]["decode_tok_per_s"], 3)
    row["same_tokens"] = arm["outputs"] == none["outputs"]
    return row


def arm_spec(args: argparse.Namespace, arm: str) -> dict[str, Any] | None:
    if arm == "none":
        return None
    if arm == "ngram":
        return spec_config(args.k, tuple(args.lookup), args.vllm_method if args.engine == "vllm" else "ngram")
    return spec_config(args.k, tuple(args.lookup), arm, Path(args.drafts_dir) / arm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["ember", "vllm"], required=True)
    ap.add_argument("--model", required=True, help="an HF model directory (vLLM: with its tokenizer), or for ember "
                                                   "a .gguf (ngram only: the drafters are cut from a directory)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=["ngram"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (1: one request at a time)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--vllm-method", choices=["ngram", "ngram_gpu"], default="ngram",
                    help="vLLM's prompt lookup: ngram (on the CPU, numba) or ngram_gpu (where numba is missing)")
    ap.add_argument("--drafts-dir", default="/tmp/spec-drafts", help="eagle3/ and draft_model/ (written if absent)")
    ap.add_argument("--draft-layers", type=int, default=4, help="the draft model's layers: the target's first N")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (the last is timed)")
    ap.add_argument("--arm", choices=["none", *METHODS], help=argparse.SUPPRESS)  # one arm, in this process
    ap.add_argument("--arm-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if any(b < 1 for b in args.batch) or args.repeats < 1:
        ap.error(f"--batch sizes and --repeats must be >= 1; got {args.batch} and {args.repeats}")
    items = json.loads(PROMPTS.read_text())[:args.prompts]
    if args.arm:
        Path(args.arm_json).write_text(json.dumps(run_arm(args.engine, args.model, arm_spec(args, args.arm), items,
                                                          args.max_tokens, args.repeats, tuple(args.batch))))
        return
    if any(not (Path(args.drafts_dir) / m / "config.json").is_file() for m in args.methods if m != "ngram"):
        from ember.bench.spec_drafts import write_drafts  # (where they are there, vLLM's run imports no ember)

        write_drafts(args.model, args.drafts_dir, args.draft_layers)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        none: list[dict[str, Any]] = []
        for arm in ("none", *dict.fromkeys(args.methods)):
            path = Path(tmp) / f"{arm}.json"
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--arm", arm, "--arm-json", str(path)],
                                  env=dict(os.environ))
            if done.returncode != 0:  # the line still says what the none arm measured
                print("RESULT " + json.dumps({"engine": args.engine, "method": arm, "error": f"the {arm} arm exited "
                                              f"{done.returncode}", "none": [arm_row(a) for a in none]}), flush=True)
                if arm == "none":
                    sys.exit(1)
                failed = True
                continue
            measured = json.loads(path.read_text())
            if arm == "none":
                none = measured
                continue
            for base, spec in zip(none, measured):
                print("RESULT " + json.dumps(summary(args.engine, base, spec, args.k)), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
