"""The host cost of a speculative-decoding step (issue #38), on the CPU: a tiny random Llama
target (hidden 64, 8 layers, float32, saved by transformers), whose forward is cheap, so that a
step's time is mostly its Python and its torch calls (at batch 32 the CPU's paged attention over
5 rows a request still weighs: compare the profiled split). Greedy requests (ignore_eos) are
driven through the engine core step by step, without speculation and with each method, at each
batch size; one line per method and batch: ms a step (the mean over the steps that start with
every request's first token sampled: wall clock, and the process's CPU time, steadier on a shared
machine; one torch thread), tokens a step, mean accepted length and decode tok/s.

    ngram        prompt lookup over a prompt that repeats itself (most drafts kept)
    eagle3       a random EAGLE-3 head at the target's shapes (ember/bench/dummy_eagle3.py):
                 about no draft kept, so every step drafts K and verifies K + 1
    draft_model  the target cut to its first layer (ember/bench/spec_drafts.py)

    PYTHONPATH=. python benchmarks/scripts/spec_host_cost.py [--methods none ngram eagle3 draft_model]
        [--batch 1 32] [--k 4] [--max-tokens 64] [--repeats 3] [--profile eagle3:32] [--top 30]

--profile METHOD:BATCH runs cProfile over that arm's decode steps in one more pass, prints its top
functions (by cumulative and by own time) and adds to its line the profiled ms a step spent in
torch's calls (here their compute; on a GPU a launch each), the rest (the host's Python), the
torch calls a step that launch work, and all function calls a step (steady where timings are not). Each timing is the best of --repeats passes, the profiled pass apart.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ember import LLM, SamplingParams  # noqa: E402
from ember.request import Request  # noqa: E402

VOCAB = 512
ENGINE = dict(dtype="float32", max_model_len=512, enable_prefix_caching=False, seed=0)


def write_target(root: Path) -> Path:
    """A random 8-layer Llama (hidden 64) saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
        vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False))
    path = root / "target"
    model.save_pretrained(path)
    return path


def spec_config(method: str, k: int, drafts: dict[str, Path]) -> dict[str, Any] | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return {"method": method, "model": str(drafts[method]), "num_speculative_tokens": k}


def prompts(batch: int) -> list[list[int]]:
    """Each a 16-token phrase said four times (prompt lookup finds its continuation)."""
    return [[(7 * i + 13 * j) % VOCAB for j in range(16)] * 4 for i in range(batch)]


def run_pass(llm: LLM, batch: int, max_tokens: int, tag: str,
             profiler: cProfile.Profile | None = None) -> tuple[list[float], list[float], int, list[list[int]]]:
    """(each decode step's seconds, its process CPU seconds, output tokens, each request's tokens)
    of one pass; a decode
    step: one that starts with every request's first token sampled."""
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [Request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts(batch))]
    for r in reqs:
        core.add_request(r)
    steps, cpu = [], []
    while core.has_unfinished_requests():
        decoding = all(r.output_token_ids for r in reqs)
        if decoding and profiler is not None:
            profiler.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        core.step()
        if decoding:
            steps.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        if profiler is not None:
            profiler.disable()
    core.finish_in_flight()
    return steps, cpu, sum(len(r.output_token_ids) for r in reqs), [list(r.output_token_ids) for r in reqs]


def measure(llm: LLM, method: str, batch: int, max_tokens: int, repeats: int, profile: bool,
            top: int) -> tuple[dict[str, Any], list[list[int]]]:
    run_pass(llm, batch, max_tokens, "warm")
    spec = llm.engine.scheduler.spec
    best: dict[str, Any] | None = None
    profiled: dict[str, float] = {}
    outputs: list[list[int]] = []
    for rep in range(repeats + profile):
        drafts0, accepted0 = spec.num_drafts, spec.num_accepted_tokens
        profiler = cProfile.Profile() if rep == repeats else None
        steps, cpu, tokens, outputs = run_pass(llm, batch, max_tokens, f"r{rep}", profiler)
        drafts, accepted = spec.num_drafts - drafts0, spec.num_accepted_tokens - accepted0
        row = {"method": method, "batch": batch, "ms_per_step": round(1e3 * sum(steps) / len(steps), 3),
               "cpu_ms_per_step": round(1e3 * sum(cpu) / len(steps), 3),
               "steps": len(steps), "tokens_per_step": round((tokens - batch) / len(steps) / batch, 2),
               "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
               "decode_tok_s": round((tokens - batch) / sum(steps), 1)}
        if profiler is None and (best is None or row["ms_per_step"] < best["ms_per_step"]):
            best = row
        if profiler:
            print(f"--- profile {method} batch {batch} ({len(steps)} steps) ---")
            stats = pstats.Stats(profiler).strip_dirs()
            profiled = host_split(stats, len(steps))
            if top:
                stats.sort_stats("cumulative").print_stats(top)
                stats.sort_stats("tottime").print_stats(top)
    return (best or row) | profiled, outputs


# torch calls that read or reshape a tensor's metadata: no kernel on any device
NO_KERNEL = ("_get_tracing_state", "_has_torch_function", "'dim'", "'size'", "'stride'", "'is_contiguous'",
             "'view'", "'reshape'", "split", "__enter__", "__exit__", "'numel'", "'data_ptr'")


def host_split(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """A profiled pass's time a step split into torch's calls (here their compute; on a GPU a
    launch each) and the rest (Python, the host's own work), the torch calls a step that launch
    work (those that only read or reshape metadata apart), and all calls a step (Python's and
    torch's: a count of the host's work that a shared machine's load does not move)."""
    ops_s = host_s = 0.0
    op_calls = 0
    for (filename, _, name), (_, calls, tottime, _, _) in stats.stats.items():
        if filename == "~" and ("torch._C" in name or "torch._ops" in name or "of 'torch." in name
                                or name.startswith("<built-in method torch.")):
            ops_s += tottime
            op_calls += 0 if any(k in name for k in NO_KERNEL) else calls
        else:
            host_s += tottime
    return {"profiled_host_ms_per_step": round(1e3 * host_s / steps, 3),
            "profiled_op_ms_per_step": round(1e3 * ops_s / steps, 3), "op_calls_per_step": round(op_calls / steps, 1),
            "calls_per_step": round(stats.total_calls / steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "eagle3", "draft_model"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", nargs="*", default=[], help="METHOD:BATCH arms to profile")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()

    import torch

    from ember.bench.spec_drafts import write_drafts

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="spec-host-"))
    target = write_target(root)
    drafts = write_drafts(target, root / "drafts", layers=1, draft_vocab=VOCAB // 2)
    reference: dict[int, list[list[int]]] = {}
    for method in args.methods:
        llm = LLM(str(target), speculative_config=spec_config(method, args.k, drafts), **ENGINE)
        for batch in args.batch:
            row, outputs = measure(llm, method, batch, args.max_tokens, args.repeats,
                                   f"{method}:{batch}" in args.profile, args.top)
            if method == "none":
                reference[batch] = outputs
            elif batch in reference:
                row["same_tokens"] = outputs == reference[batch]
            print(row, flush=True)
        llm.shutdown() if hasattr(llm, "shutdown") else None
        del llm


if __name__ == "__main__":
    main()
