"""`ember bench throughput`: offline throughput on random prompts, as `vllm bench throughput`
measures it with its random dataset.

All prompts go to one `LLM.generate` call with `SamplingParams(n=1, temperature=1.0,
top_p=1.0, ignore_eos=True, max_tokens=output_len)`; only that call is timed, after the model
is loaded and a tiny warm-up generate has paid the one-time costs. `--compare hf` then runs
the same prompts through HF transformers (see hf_baseline.py) in the same process.
`--structured-output json` runs the same prompts twice back to back, free and then each
constrained by BENCH_SCHEMA (JSON records that cannot close within the output length,
so both runs produce the same number of tokens), and reports the ratio of output tok/s.

The printed report and the `--output-json` file are both made from one dict:

    {"config": {...flags}, "engine": {...resolved}, "date": ISO, "machine": {...},
     "results": {"ember": {...}, "hf": {...}, "ember_over_hf_output_tok_s": R,
                 "ember_json": {...}, "json_over_free_output_tok_s": R}}
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ember.bench.results import RandomRequest, ThroughputResult

# -- flags --------------------------------------------------------------------------------


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags (vLLM's random dataset); `--seed` comes with the engine flags and
    seeds both the dataset and the engine, as in vLLM."""
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request (mean)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (mean)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths are drawn uniformly from [len*(1-r), len*(1+r)]; 0 <= r < 1")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--compare", choices=["hf"], default=None,
                        help="also run the same workload through HF transformers' generate")
    parser.add_argument("--hf-dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="static batch size (default: all prompts)")
    parser.add_argument("--structured-output", choices=["json"], default=None,
                        help="also run every prompt constrained by a JSON schema, back to back with the free run")
    parser.add_argument("--output-json", default=None, help="write the config, machine and results here")
    parser.add_argument("--profile-steps", action="store_true",
                        help="time each step's phases (schedule, prepare, forward, sample, wait, update): with "
                             "device syncs, or with async scheduling the CPU's time in each (no syncs)")


# a list of records: the array has no upper bound and more items than fit in --output-len,
# so no constrained request ends before its max_tokens (as the free ones, with ignore_eos)
BENCH_SCHEMA = {
    "type": "object", "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 1000, "items": {
        "type": "object", "required": ["id", "name", "status", "score"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 12},
                       "status": {"enum": ["active", "inactive", "pending"]},
                       "score": {"type": "number"}}}}},
}


# -- the random dataset -------------------------------------------------------------------


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, special_ids: Sequence[int], seed: int) -> list[RandomRequest]:
    """vLLM's random dataset, kept as token ids (no decode/re-encode round trip).

    Lengths are integers drawn uniformly from [floor(len*(1-r)), ceil(len*(1+r))] (output at
    least 1). Prompt i is a run of consecutive allowed ids from a random offset:
    allowed[(offset_i + i + arange(input_len_i)) % len(allowed)], special ids left out.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1); got {range_ratio}")
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1; got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo, out_hi = max(1, math.floor(output_len * (1 - range_ratio))), max(1, math.ceil(output_len * (1 + range_ratio)))
    if in_lo < 1:
        raise ValueError(f"--input-len {input_len} with --range-ratio {range_ratio} allows empty prompts: "
                         "raise --input-len or lower --range-ratio")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    offsets = rng.integers(0, vocab_size, size=num_prompts)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    return [
        RandomRequest(allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist(), int(output_lens[i]))
        for i in range(num_prompts)
    ]


# -- running ------------------------------------------------------------------------------


def bench_ember(llm: Any, requests: list[RandomRequest], schema: dict[str, Any] | None = None) -> ThroughputResult:
    from ember.sampling_params import SamplingParams, StructuredOutputsParams

    structured = StructuredOutputsParams(json=schema) if schema is not None else None

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=max_tokens,
                              structured_outputs=structured)

    llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids[:4]}], params(2))  # warm-up (and compile)
    llm.engine.runner.step_times.clear()  # the profile counts the timed run only
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    cached = getattr(llm.engine.prefix_cache, "num_cached_blocks", 0)
    if cached:  # each timed run starts cold: the free and the constrained run share their prompts
        llm.engine.prefix_cache.evict(cached)
    forced = llm.engine.structured.num_forced_tokens
    start = time.perf_counter()
    outputs = llm.generate(prompts, [params(r.output_len) for r in requests])
    elapsed = time.perf_counter() - start
    cfg = llm.config
    return ThroughputResult(
        label=f"ember ({_engine_label(cfg)})" + (", JSON schema" if schema else ""),
        num_requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        elapsed_s=elapsed,
        forced_tokens=llm.engine.structured.num_forced_tokens - forced,
    )


def _engine_label(cfg: Any) -> str:
    """The model, dtype, weight quantization and KV-cache dtype where not the default, device."""
    parts = [Path(cfg.model).name, cfg.dtype]
    parts += [f"{cfg.quantization} weights"] if cfg.quantization != "none" else []
    parts += [f"{cfg.kv_cache_dtype} KV"] if cfg.kv_cache_dtype != "auto" else []
    return ", ".join(parts + [cfg.device])


def run_throughput(ns: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run the benchmark the flags describe; print the report, write it if asked, return it."""
    import logging

    from ember import LLM

    for name in ("ember.runner", "ember.defaults"):  # the memory breakdown, graph capture time, the settings
        logging.getLogger(name).setLevel(logging.INFO)
    start = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - start  # load, memory profile, KV pool, CUDA graphs: ready to serve
    cfg = llm.config
    tok = llm.tokenizer
    vocab = min(tok.vocab_size, cfg.model_config.vocab_size) if tok else cfg.model_config.vocab_size
    requests = random_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab,
                               tok.all_special_ids if tok else [], ns.seed)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > cfg.max_model_len:
        raise ValueError(f"a request needs up to {longest} tokens (prompt + output) but max_model_len is "
                         f"{cfg.max_model_len}: lower --input-len/--output-len or raise --max-model-len")

    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(ns).items() if k != "func"},
        "engine": {k: getattr(cfg, k) for k in ("model", "load_format", "dtype", "quantization", "kv_cache_dtype",
                                                 "device", "max_model_len", "block_size", "num_kv_blocks",
                                                 "max_num_seqs", "max_num_batched_tokens", "async_scheduling")},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(cfg.device),
        "results": {"ember": {}},
    }
    runner = llm.engine.runner
    runner.profile_steps = getattr(ns, "profile_steps", False)
    scheduler = llm.engine.scheduler
    preempted, swapped = scheduler.num_preemptions, scheduler.num_swapped
    ember = report["results"]["ember"] = bench_ember(llm, requests).to_dict() | {"startup_s": startup_s}
    ember["preemptions"] = scheduler.num_preemptions - preempted
    ember["preemptions_by_swap"] = scheduler.num_swapped - swapped  # --preemption-mode swap / auto; the rest recomputed
    ember["memory_gib"] = {"weights": runner.weight_bytes / 2**30, "peak_activations": runner.activation_bytes / 2**30,
                           "kv_cache": runner.kv_cache_bytes / 2**30, "kv_blocks": runner.num_blocks}
    if runner.graphs is not None:
        ember["cuda_graphs"] = {"count": len(runner.graphs.sizes), "capture_s": runner.graphs.capture_seconds,
                                "pool_gib": runner.graphs.pool_bytes / 2**30}
    if runner.piecewise is not None:
        ember["piecewise_graphs"] = {"token_counts": runner.piecewise.sizes,
                                     "capture_s": runner.piecewise.capture_seconds,
                                     "pool_gib": runner.piecewise.pool_bytes / 2**30}
    if runner.profile_steps:
        times = dict(runner.step_times)
        steps = times.pop("steps", 0) or 1
        ember["profile_ms_per_step"] = {k: 1e3 * v / (steps if k != "steps" else 1) for k, v in times.items()}
        ember["profile_steps"] = steps
        ember["profile_note"] = ("tensor parallel: the engine's side; send = the plan to the ranks, wait = their "
                                 "forward and sampling" if cfg.tensor_parallel_size > 1 else
                                 "async scheduling: CPU time of each phase, no device syncs (forward and sample "
                                 "are launch times); wait = the CPU waiting for sampled ids"
                                 if cfg.async_scheduling else "a device sync ends each phase")
    if cfg.device == "cuda":
        from ember.bench.roofline import workload_floor

        floor = workload_floor(cfg.model_config, [(len(r.prompt_token_ids), r.output_len) for r in requests],
                               cfg.max_num_seqs)
        ember["floor_output_tokens_per_s"] = floor.output_tokens_per_s
        ember["roofline"] = floor.describe(ember["output_tokens_per_s"])
    if ns.structured_output == "json":
        results = report["results"]
        results["ember_json"] = bench_ember(llm, requests, BENCH_SCHEMA).to_dict()
        results["json_over_free_output_tok_s"] = (results["ember_json"]["output_tokens_per_s"]
                                                  / results["ember"]["output_tokens_per_s"])
    if ns.compare == "hf":
        model_path, load_format, device = cfg.model, cfg.load_format, cfg.device
        del llm, cfg, runner  # free ember's weights and KV cache before HF loads its copy
        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
        from ember.bench.hf_baseline import bench_hf

        hf = bench_hf(model_path, requests, dtype=ns.hf_dtype, batch_size=ns.hf_batch_size or len(requests),
                      seed=ns.seed, device=device, random_weights=load_format == "dummy").to_dict()
        results = report["results"]
        results["hf"] = hf
        results["ember_over_hf_output_tok_s"] = results["ember"]["output_tokens_per_s"] / hf["output_tokens_per_s"]

    print(format_report(report))
    if ns.output_json:
        path = Path(ns.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


# -- reporting ----------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    """vLLM's three lines per engine, then the ratio when there is a baseline."""
    lines = []
    results = report["results"]
    for name in ("ember", "ember_json", "hf"):
        if name in results:
            r = results[name]
            lines += [
                f"== {r['label']} ==",
                f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.2f} total tokens/s, "
                f"{r['output_tokens_per_s']:.2f} output tokens/s",
                f"Total num prompt tokens:  {r['prompt_tokens']}",
                f"Total num output tokens:  {r['output_tokens']}",
            ]
            if "startup_s" in r:
                lines.append(f"Start-up to ready: {r['startup_s']:.1f} s")
            if "memory_gib" in r:
                m = r["memory_gib"]
                swapped = f" ({r['preemptions_by_swap']} by swap)" if r.get("preemptions_by_swap") else ""
                lines.append(f"KV cache: {m['kv_blocks']} blocks, {m['kv_cache']:.2f} GiB; preemptions: "
                             f"{r.get('preemptions', 0)}{swapped}")
            if "roofline" in r:
                lines.append(f"Roofline: {r['roofline']}")
            if "profile_ms_per_step" in r:
                lines.append(f"Per step ({r['profile_steps']} steps), ms: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r["profile_ms_per_step"].items()) + f" ({r['profile_note']})")
            if name == "ember_json":
                lines.append(f"Output tokens appended by jump-forward:  {r['forced_tokens']}")
    if "ember_over_hf_output_tok_s" in results:
        lines.append(f"ember/hf output tok/s = {results['ember_over_hf_output_tok_s']:.2f}")
    if "json_over_free_output_tok_s" in results:
        lines.append(f"json/free output tok/s = {results['json_over_free_output_tok_s']:.2f}")
    return "\n".join(lines)


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info = {
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if device == "cuda":
        import triton

        info["gpu"] = torch.cuda.get_device_name()
        info["triton"] = triton.__version__
        info["cuda"] = torch.version.cuda
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
