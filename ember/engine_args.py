"""The engine's flags under vLLM's names, and the EngineConfig arguments they make: shared by
the `ember` commands (server/cli.py) and `ember tune` (bench/tune.py), so neither imports the
other."""

from __future__ import annotations

import argparse
from typing import Any

from ember.config import EngineConfig
from ember.defaults import TUNING_KNOBS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names; defaults come from EngineConfig."""
    d = EngineConfig()
    parser.add_argument("model", nargs="?", default=None,
                        help="a .gguf file, an HF model directory, or a Hugging Face Hub id: org/name, or "
                             "org/name-GGUF:Q4_K_M for one quant of a GGUF repo (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the model, as the positional argument (give one or the other, or the same in both)")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="flags from a YAML file (keys: flag names, with dashes or underscores); flags given "
                             "on the command line override it")
    parser.set_defaults(config_parser=parser)
    parser.add_argument("--revision", default=d.revision,
                        help="hub ids: the branch, tag or commit hash to fetch (default: main)")
    parser.add_argument("--download-dir", default=d.download_dir,
                        help="hub ids: the cache folder to fetch into (default: huggingface_hub's, HF_HUB_CACHE)")
    parser.add_argument("--tokenizer", default=d.tokenizer,
                        help="the tokenizer: a directory, a .gguf file or a hub id (default: the model's)")
    parser.add_argument("--chat-template", default=d.chat_template,
                        help="the chat template: a file, or the Jinja text itself (default: the tokenizer's)")
    parser.add_argument("--generation-config", default=d.generation_config, choices=["auto", "vllm"],
                        help="auto: the sampling defaults in the model's generation_config.json apply to requests "
                             "that leave them unset; vllm: ignore them")
    parser.add_argument("--load-format", default=d.load_format, choices=["auto", "gguf", "safetensors", "pt", "dummy"],
                        help="pt: pytorch_model*.bin files (auto takes them where a directory has no safetensors)")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 on CUDA; on the CPU float32 for GGUF blocks, else bfloat16 where the "
                             "CPU computes it natively (AVX512_BF16, AMX), float32 elsewhere")
    parser.add_argument("--quantization", default=d.quantization, choices=["auto", "none", "gguf", "fp8"],
                        help="auto: a GGUF file's quantized weights stay in their blocks on the CPU (int8 kernels, "
                             "as llama.cpp), an FP8 checkpoint's stay in FP8 on CUDA; none: dequantize every "
                             "weight to --dtype; fp8: every linear layer in FP8 (a bf16 checkpoint or dummy "
                             "weights quantized per output row at load; the LM head and embedding stay in --dtype)")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                        choices=["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3"],
                        help="KV cache storage: auto (the model dtype; float16 with GGUF blocks on the CPU, as "
                             "llama.cpp), float32, float16, bfloat16, or fp8 (e4m3, scale 1.0): half the bytes per token, "
                             "twice the blocks")
    parser.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="tokens a KV block (default: 128 on CUDA, 16 on the CPU)")
    parser.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    parser.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="bytes for the KV cache")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="split the model's layers over N worker processes (gloo on the CPU, one GPU each on "
                             "CUDA); the heads must divide among them")
    parser.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=d.distributed_executor_backend,
                        help="mp: the tensor-parallel workers are processes of this machine; ray: Ray actors on the "
                             "cluster RAY_ADDRESS names (or a new local one), ranks possibly on several nodes. "
                             "Default: mp when --tensor-parallel-size > 1, else the engine's own process")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="tensor parallelism on GPUs: every all-reduce through NCCL (default: a decode step's "
                             "small ones in one kernel over the GPUs' mapped memory, where they share a host)")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch invariance on every path: a request's output does not depend on its batch, "
                             "chunking or prefix-cache hits (on CUDA one Triton matmul for every batch size and "
                             "decode through the prefill attention kernel: slower; the CPU's GGUF path is so "
                             "already)")
    parser.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority", "lpm"],
                        help="waiting requests go in arrival order, by priority, or longest cached prefix first")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching, help="reuse the KV of earlier requests' common prefixes")
    parser.add_argument("--structured-outputs-backend", default=d.structured_outputs_backend,
                        choices=["xgrammar", "guidance"], help="the grammar backend for structured output")
    parser.add_argument("--no-jump-forward", dest="structured_outputs_jump_forward", action="store_false",
                        help="structured output: sample every token, even those the grammar forces")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="schedule and prepare the next step while the device runs this one "
                             "(default: on for CUDA, off on the CPU)")
    parser.add_argument("--runner", default=None, choices=["generate", "pooling"],
                        help="generate: complete text (default); pooling: embeddings (/v1/embeddings, LLM.embed) "
                             "from the final hidden states, as --pooler-config says")
    parser.add_argument("--task", default=None, choices=["generate", "embed"],
                        help="vLLM's older name: --task embed is --runner pooling")
    parser.add_argument("--pooler-config", default=None, metavar="JSON",
                        help='with --runner pooling: \'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": '
                             'true | false}\' (default: the last token, L2-normalized)')


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    names = ["revision", "download_dir", "tokenizer", "chat_template", "generation_config", "load_format", "dtype", "quantization", "kv_cache_dtype", "device", "max_model_len", "block_size", "num_kv_blocks",
             "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "seed", "enforce_eager",
             "scheduling_policy", "enable_prefix_caching",
             "structured_outputs_backend", "structured_outputs_jump_forward", "async_scheduling",
             "tensor_parallel_size", "distributed_executor_backend", "disable_custom_all_reduce", "deterministic"]
    from_file = getattr(ns, "from_config_file", {})
    sources = {n: "config file" if n in from_file else "flag" for n in TUNING_KNOBS}
    return {"model": model_arg(ns), "runner": runner_arg(ns), "pooler_config": ns.pooler_config,
            "setting_sources": sources} | {n: getattr(ns, n) for n in names}


def runner_arg(ns: argparse.Namespace) -> str:
    """--runner, or --task (its older name: embed is pooling); ValueError if they disagree."""
    from_task = {"embed": "pooling", "generate": "generate", None: None}[ns.task]
    if ns.runner is not None and from_task is not None and ns.runner != from_task:
        raise ValueError(f"--task {ns.task} means --runner {from_task}, but --runner {ns.runner} is given: give one")
    return ns.runner or from_task or "generate"


def model_arg(ns: argparse.Namespace) -> str | None:
    """The model: the positional argument or --model (ValueError if they differ)."""
    if ns.model is not None and ns.model_flag is not None and ns.model != ns.model_flag:
        raise ValueError(f"the model is given twice, as {ns.model!r} and --model {ns.model_flag!r}: give one")
    return ns.model if ns.model is not None else ns.model_flag
