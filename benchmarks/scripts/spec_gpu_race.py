"""Issue #38's race: prompt-lookup speculation (`ngram`) against none, one request at a time,
greedy, on the input-grounded prompts of benchmarks/spec_ngram_prompts.json, for ember or vLLM
0.24 on the same model directory (h200.sh spec-race: real SmolLM2-135M-Instruct weights in bf16,
benchmarks/scripts/smol_stage.py), one RESULT line (JSON) per engine:

    python3 benchmarks/scripts/spec_gpu_race.py --engine ember|vllm --model DIR_OR_GGUF
        [--max-tokens 256] [--k 4] [--lookup 2 4] [--prompts N] [--repeats 2] [--vllm-method ngram]

Each arm (none, then ngram with K drafts, prompt_lookup_min/max) runs in its own process (a
second vLLM engine in one process cannot have the GPU memory the first holds), prefix cache off,
max_model_len 2048: for every prompt in turn a max_tokens=1 run, then the max_tokens run; the
first pass over the prompts warms up, the last is timed. tok/s after the first token is
spec_ngram.py's: (output tokens - one per request) / (time of the full runs - time of the
max_tokens=1 runs). Acceptance over the timed pass: ember's scheduler counters, vLLM's
spec_decode counters (LLM.get_metrics, stats on). same_tokens: the ngram arm's outputs are the
none arm's, token for token; prompt_sha256 hashes every prompt's token ids, so two engines'
lines say whether they were given the same prompts. vLLM's `ngram` proposer runs on the CPU
through numba (smol_stage.py stages its wheels); --vllm-method ngram_gpu is vLLM's GPU prompt
lookup, for a device where numba will not import (the line's "method" says which ran).
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
VLLM_SPEC = "vllm:spec_decode_num_"  # its counters: ...drafts, ...draft_tokens, ...accepted_tokens


def spec_config(k: int, lookup: tuple[int, int], method: str = "ngram") -> dict[str, Any]:
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
            "prompt_lookup_max": lookup[1]}


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


def _counters(engine: str, llm: Any) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) so far."""
    if engine == "vllm":
        got = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        for m in llm.get_metrics():
            what = m.name.removeprefix(VLLM_SPEC).removesuffix("_total")
            if m.name.startswith(VLLM_SPEC) and what in got:
                got[what] += int(m.value)
        return got["drafts"], got["draft_tokens"], got["accepted_tokens"]
    spec = llm.engine.scheduler.spec
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens


def run_arm(engine: str, model: str, spec: dict[str, Any] | None, items: list[dict], max_tokens: int,
            repeats: int = 2) -> dict[str, Any]:
    """One arm of one engine over `items` (module docstring): times, tokens, counters, outputs."""
    llm, SamplingParams = _open(engine, model, spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    first = SamplingParams(temperature=0, max_tokens=1)
    for rep in range(repeats):
        timed = rep == repeats - 1
        if timed:
            before = _counters(engine, llm)
            seconds = prefill = 0.0
            outputs: list[list[int]] = []
            prompt_hash = hashlib.sha256()
        for item in items:
            start = time.perf_counter()
            llm.chat([item["messages"]], first, use_tqdm=False)
            to_first = time.perf_counter() - start
            start = time.perf_counter()
            out = llm.chat([item["messages"]], params, use_tqdm=False)[0]
            took = time.perf_counter() - start
            if timed:
                seconds += took
                prefill += to_first
                outputs.append(list(out.outputs[0].token_ids))
                prompt_hash.update(json.dumps(list(out.prompt_token_ids)).encode())
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_counters(engine, llm), before))
    return {"method": spec["method"] if spec else "none", "seconds": seconds, "prefill_seconds": prefill, "outputs": outputs, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted, "prompt_sha256": prompt_hash.hexdigest()}


def arm_row(arm: dict[str, Any]) -> dict[str, Any]:
    """One arm's numbers: output tokens, seconds, tok/s end to end and after the first token."""
    tokens = sum(len(o) for o in arm["outputs"])
    decode = (tokens - len(arm["outputs"])) / (arm["seconds"] - arm["prefill_seconds"])
    row = {"output_tokens": tokens, "seconds": round(arm["seconds"], 3), "tok_per_s": round(tokens / arm["seconds"], 2),
           "decode_tok_per_s": round(decode, 2)}
    if arm["drafts"]:
        row["mean_accepted_length"] = round(1 + arm["accepted_tokens"] / arm["drafts"], 3)
        row["acceptance_rate"] = round(arm["accepted_tokens"] / arm["draft_tokens"], 3)
    return row


def summary(engine: str, none: dict[str, Any], ngram: dict[str, Any], k: int) -> dict[str, Any]:
    """The RESULT line of one engine from its two arms."""
    row: dict[str, Any] = {"engine": engine, "method": ngram["method"], "prompts": len(none["outputs"]), "k": k,
                           "prompt_sha256": none["prompt_sha256"],
                           "same_prompts": none["prompt_sha256"] == ngram["prompt_sha256"],
                           "none": arm_row(none), "ngram": arm_row(ngram)}
    row["decode_speedup"] = round(row["ngram"]["decode_tok_per_s"] / row["none"]["decode_tok_per_s"], 3)
    row["same_tokens"] = ngram["outputs"] == none["outputs"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["ember", "vllm"], required=True)
    ap.add_argument("--model", required=True, help="an HF model directory (vLLM: with its tokenizer), or for ember "
                                                   "a .gguf")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--vllm-method", choices=["ngram", "ngram_gpu"], default="ngram",
                    help="vLLM's prompt lookup: ngram (on the CPU, numba) or ngram_gpu (where numba is missing)")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (the last is timed)")
    ap.add_argument("--arm", choices=["none", "ngram"], help=argparse.SUPPRESS)  # one arm, in this process
    ap.add_argument("--arm-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    items = json.loads(PROMPTS.read_text())[:args.prompts]
    if args.arm:
        method = args.vllm_method if args.engine == "vllm" else "ngram"
        spec = spec_config(args.k, tuple(args.lookup), method) if args.arm == "ngram" else None
        Path(args.arm_json).write_text(json.dumps(run_arm(args.engine, args.model, spec, items, args.max_tokens,
                                                          args.repeats)))
        return
    arms = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("none", "ngram"):
            path = Path(tmp) / f"{arm}.json"
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--arm", arm, "--arm-json", str(path)],
                                  env=dict(os.environ))
            if done.returncode != 0:  # the line still says what the arms before it measured
                print("RESULT " + json.dumps({"engine": args.engine, "error": f"the {arm} arm exited {done.returncode}",
                                              **{name: arm_row(a) for name, a in arms.items()}}), flush=True)
                sys.exit(1)
            arms[arm] = json.loads(path.read_text())
    print("RESULT " + json.dumps(summary(args.engine, arms["none"], arms["ngram"], args.k)), flush=True)


if __name__ == "__main__":
    main()
