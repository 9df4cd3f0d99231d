"""EngineConfig: user flags (vLLM's names), validated, and `resolve()`: the one place where
flags + model + hardware become the numbers every part uses. Frozen; never mutated."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args, get_origin, get_type_hints

import torch

from ember.defaults import USAGES, log_settings, scheduling_defaults
from ember.models.config import ModelConfig
from ember.pooling import PoolerConfig
from ember.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype: auto stores K/V in the model dtype; fp8 (= fp8_e4m3) in float8_e4m3fn
_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, **_DTYPES}
DEFAULT_IMAGES_PER_PROMPT = 16
DEFAULT_VIDEOS_PER_PROMPT = 1
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
CPU_KV_CACHE_MEMORY = 1 << 30  # default KV pool on the CPU: 1 GiB (vLLM's CPU backend uses 4)


def flag(default: Any, help: str, *, flags: tuple[str, ...] = (), action: str | None = None,
         metavar: str | None = None, knob: bool = False) -> Any:
    """An EngineConfig field that is also a command-line flag (engine_args.py derives the
    parser, the YAML keys and the argument list from these): `help` is its --help text,
    `flags` its option strings (default: --the-field-name), `action` an argparse action
    that the type alone does not give, `knob` a tuning knob (logged at start with where its
    value came from, and one that `ember tune` may sweep). A Literal type is its choices."""
    return field(default=default, metadata=dict(help=help, flags=flags, action=action, metavar=metavar, knob=knob))


SWAP_SPACE_GIB = 4.0  # vLLM's default swap_space
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "float16", "bfloat16", "float32"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class EngineConfig:
    """Fields made with `flag` are the engine's flags (vLLM's names); the rest are set by the
    caller (usage_context, setting_sources) or by resolve()."""

    model: str | None = flag(
        None, "a .gguf file, an HF model directory, or a Hugging Face Hub id: org/name, or org/name-GGUF:Q4_K_M "
        "for one quant of a GGUF repo (default: SmolLM2-135M-Instruct Q4_1)")  # resolve(): a local path
    revision: str | None = flag(None, "hub ids: the branch, tag or commit hash to fetch (default: main)")
    download_dir: str | None = flag(
        None, "hub ids: the cache folder to fetch into (default: huggingface_hub's, HF_HUB_CACHE)")
    tokenizer: str | None = flag(None, "the tokenizer: a directory, a .gguf file or a hub id (default: the model's)")
    chat_template: str | None = flag(  # resolve(): the text
        None, "the chat template: a file, or the Jinja text itself (default: the tokenizer's)")
    generation_config: Literal["auto", "vllm"] = flag(
        "auto", "auto: the sampling defaults in the model's generation_config.json apply to requests that leave "
        "them unset (vLLM's default); vllm: ignore them (ember's own defaults, SamplingParams)")
    override_generation_config: str | None = flag(
        None, "a JSON object of sampling defaults over generation_config.json's, for requests that leave them "
        "unset, e.g. '{\"temperature\": 0.5, \"top_p\": 0.9}' (vLLM's; keys: temperature, top_p, top_k, min_p, "
        "repetition_penalty, presence_penalty, frequency_penalty)", metavar="JSON")
    load_format: Literal["auto", "gguf", "safetensors", "pt", "dummy"] = flag(
        "auto", "pt: pytorch_model*.bin files (auto takes them where a directory has no safetensors); dummy: "
        "random weights at the model's shapes")
    dtype: Dtype = flag(
        "auto", "auto: bfloat16 on CUDA; on the CPU float32 for GGUF blocks (the kernels take float32 "
        "activations, as llama.cpp's do), else bfloat16 where the CPU computes it natively (AVX512_BF16, AMX), "
        "float32 elsewhere")
    # resolve() names what runs: gguf | fp8 | awq | gptq | compressed-tensors | none
    quantization: Literal["auto", "none", "gguf", "fp8", "awq", "gptq", "compressed-tensors"] = flag(
        "auto", "auto: a GGUF file's quantized weights stay in their blocks (int8 kernels on the CPU, as "
        "llama.cpp; Triton kernels on CUDA), an FP8 checkpoint's stay in FP8 on CUDA, an AWQ / GPTQ / compressed-tensors pack-quantized "
        "checkpoint's integer weights stay packed (Triton kernels on CUDA, GGUF blocks on the CPU); none: "
        "dequantize every weight to --dtype; fp8: every linear layer in FP8 (an FP8 checkpoint's own scales; a "
        "bf16 checkpoint or dummy weights quantized per output row at load; the LM head and embedding stay in "
        "--dtype); awq, gptq, compressed-tensors: the checkpoint's method, named (another is refused)")
    device: Literal["auto", "cpu", "cuda"] = flag("auto", "auto: CUDA where torch sees a GPU, else the CPU")
    max_model_len: int | None = flag(
        None, "the longest prompt + output in tokens (default: the model's context)",
        flags=("--max-model-len", "--context-length"))
    num_kv_blocks: int | None = flag(None, "the KV pool's size in blocks (vLLM's num_gpu_blocks_override)")
    preemption_mode: Literal["recompute", "swap", "auto"] = flag(
        "recompute", "how a preempted request keeps its KV: recompute (drop it, compute it again), swap (copy its "
        "blocks to --swap-space GiB of host memory and back), auto (swap a context of 512 tokens or more, recompute "
        "a shorter one)")
    swap_space: float = flag(SWAP_SPACE_GIB, "GiB of host memory for --preemption-mode swap / auto (vLLM's swap_space)")
    kv_offload_gib: float | None = flag(
        None, "GiB of host memory that keep the KV blocks the prefix cache evicts, so a later request with that "
        "prefix loads them back instead of recomputing (0: off; default: on CUDA as large as the KV pool, at most "
        "1/4 of the host's memory shared by the engines of this host, down to a power of two of bytes, its pinned "
        "buffers made after start-up; off "
        "on the CPU and where the tier is not supported)")
    num_state_snapshots: int | None = flag(
        None, "models with linear-attention layers (Qwen3-Next): snapshots of their recurrent state kept at block "
        "boundaries for prefix-cache hits (default: as many as a quarter of the cache memory holds, at most one a "
        "KV block)")
    kv_cache_memory: int | None = flag(None, "bytes for the KV pool, and a linear-attention model's state "
                                             "snapshots (default: what --gpu-memory-utilization leaves on CUDA, "
                                             "1 GiB on the CPU)")
    max_num_seqs: int | None = flag(
        None, "seats: the most sequences a step runs (default: per device and use, defaults.py, e.g. 512 offline "
        "on a large GPU, 256 serving; lowered to what the KV pool holds)", knob=True,
        flags=("--max-num-seqs", "--max-running-requests"))
    max_num_batched_tokens: int | None = flag(
        None, "the token budget of a step: prefill chunks and decodes together (default: per device and use, "
        "defaults.py, e.g. 16384 offline on a large GPU, 2048 serving, 512 on the CPU)", knob=True,
        flags=("--max-num-batched-tokens", "--chunked-prefill-size"))
    max_num_encoder_input_tokens: int | None = flag(
        None, "vision-language models: the image placeholder tokens whose encoding one step may start (vLLM's "
        "encoder budget); a prefill chunk that would start an image past it stops right before that image, and "
        "a step's first image always goes (default: max_num_batched_tokens)", metavar="N")
    gpu_memory_utilization: float = flag(
        0.9, "the share of the GPU's memory for weights, activations, CUDA graphs and the KV pool", knob=True,
        flags=("--gpu-memory-utilization", "--mem-fraction-static"))
    block_size: int | None = flag(
        None, "tokens a KV block (default: 128 on CUDA, where an attention tile is then one block: one "
        "block-table read a tile, 16-20 %% faster decode over fp8 on the H200; 16 on the CPU)", knob=True)
    kv_cache_dtype: KVCacheDtype = flag(
        "auto", "KV cache storage: auto (the model dtype; float16 with GGUF blocks on the CPU, llama.cpp's "
        "default cache type: a batch's decode reads as many KV bytes as weight bytes there), float32, float16, "
        "bfloat16, or fp8 (= fp8_e4m3; per-layer scales, 1.0 unless the checkpoint has them): half the bytes a "
        "token, twice the blocks", knob=True)
    scheduling_policy: Literal["fcfs", "priority", "lpm"] = flag(
        "fcfs", "waiting requests go in arrival order, by priority, or longest cached prefix first", knob=True,
        flags=("--scheduling-policy", "--schedule-policy"))
    async_scheduling: bool | None = flag(
        None, "schedule and prepare the next step while the device runs this one (vLLM's flag; default: on for "
        "CUDA, off on the CPU, where torch runs synchronously and there is nothing to overlap)", knob=True)
    enable_prefix_caching: bool = flag(True, "reuse the KV of earlier requests' common prefixes", knob=True)
    usage_context: str = "offline"  # offline (LLM, ember bench) | serve (ember serve): picks the defaults above
    # knob -> where the caller took its value ("flag", "config file"); logged at start. After
    # resolve(): the knobs the caller set, and only those (the others took the defaults)
    setting_sources: dict[str, str] = field(default_factory=dict)
    seed: int = flag(0, "the seed of dummy weights and of requests that bring none", flags=("--seed", "--random-seed"))
    enforce_eager: bool = flag(
        False, "CUDA: no CUDA graphs (every step launches its kernels)",
        flags=("--enforce-eager", "--disable-cuda-graph"))
    mixed_graph_max_tokens: int = flag(
        512, "CUDA: mixed and prefill steps of up to this many tokens replay piecewise CUDA graphs (attention "
        "eager between them; one GPU); 0: such steps run eager", metavar="N")
    attention_backend: Literal["auto", "torch", "triton"] = flag(
        "auto", "auto: triton on CUDA, torch (with the C++ kernels) on the CPU")
    structured_outputs_backend: Literal["xgrammar", "guidance", "llguidance"] = flag(
        "xgrammar", "the grammar backend for structured output (guidance and llguidance, SGLang's name, are "
        "llguidance)",
        flags=("--structured-outputs-backend", "--grammar-backend"))
    structured_outputs_jump_forward: bool = flag(
        True, "structured output: sample every token, even those the grammar forces (default: append forced "
        "tokens without a forward each)", flags=("--no-jump-forward",), action="store_false")
    # pooling: no sampling, no prefix cache (a hit would skip positions that mean pooling reads)
    runner: Literal["auto", "generate", "pooling"] = flag(
        "auto", "auto (default): pooling for an encoder (BERT, XLM-RoBERTa) or a classification model, else "
        "generate; generate: complete text; pooling: embeddings (/v1/embeddings, LLM.embed) from the final hidden "
        "states, as --pooler-config says, and a classification model's scores (/classify, LLM.classify)")
    pooler_config: PoolerConfig | None = flag(  # a JSON string or dict from callers, a PoolerConfig after init
        None, 'with --runner pooling: \'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true | false}\' '
        "(default: the last token, L2-normalized)", metavar="JSON")
    speculative_config: SpeculativeConfig | None = flag(  # a JSON string or dict from callers, parsed at init
        None, 'speculative decoding (vLLM\'s JSON): \'{"method": "ngram", "num_speculative_tokens": K}\' with '
        "optional prompt_lookup_min / prompt_lookup_max (default 5) and disable_by_batch_size: a request's decode "
        "step also verifies K drafted tokens and keeps those the model agrees with (the output is what it would be "
        "without; with async scheduling a step that verifies drafts or drafts after it runs synchronously, the "
        "others, above disable_by_batch_size, async)", metavar="JSON")
    # Megatron splits (heads, MLP rows, vocabulary), one worker process a rank (runner/tensor_parallel.py)
    tensor_parallel_size: int = flag(
        1, "split the model's layers over N worker processes (gloo on the CPU, one GPU each on CUDA); the heads "
        "must divide among them", flags=("--tensor-parallel-size", "-tp", "--tp-size", "--tp"))
    # size 1 with mp or ray still runs the one rank as a worker, as vLLM's executors do
    distributed_executor_backend: Literal["mp", "ray"] | None = flag(
        None, "mp: the tensor-parallel workers are processes of this machine; ray: Ray actors on the cluster "
        "RAY_ADDRESS names (or a new local one), placed by a placement group, ranks possibly on several nodes. "
        "Default: mp when --tensor-parallel-size > 1, else the engine's own process")
    disable_custom_all_reduce: bool = flag(
        False, "tensor parallelism on GPUs: every all-reduce through NCCL (default: a decode step's small ones, up "
        "to 8 MiB, in one kernel over the GPUs' mapped memory, distributed/peer_all_reduce.py, where they share "
        "a host)")
    # layers/batch_invariant.py; costs speed (benchmarks/BENCHMARKS.md)
    deterministic: bool = flag(
        False, "batch invariance on every path: a request's output does not depend on its batch, chunking or "
        "prefix-cache hits (on CUDA one Triton matmul for every batch size and decode through the prefill "
        "attention kernel: slower; on the CPU dense layers in fixed blocks of rows; the CPU's GGUF path is so "
        "already)")
    # images (a vision-language model): what one prompt may bring, and from where
    limit_mm_per_prompt: dict[str, int] | None = flag(  # a JSON string or dict from callers, a dict after init
        None, 'the most items of each modality one prompt may bring (vLLM\'s JSON), e.g. \'{"image": 2}\' '
        f'(default: {DEFAULT_IMAGES_PER_PROMPT} images, {DEFAULT_VIDEOS_PER_PROMPT} video)', metavar="JSON")
    allowed_local_media_path: str | None = flag(
        None, "image URLs file://PATH are read where PATH is under this folder (default: file:// URLs are refused)",
        metavar="DIR")
    max_image_pixels: int = flag(
        DEFAULT_MAX_IMAGE_PIXELS, "the most pixels (width x height) an image may have; read from its header, "
        "before it is decoded", metavar="N")
    mmproj: str | None = flag(
        None, "a GGUF model's vision tower and projector: the mmproj file llama.cpp's convert_hf_to_gguf.py --mmproj "
        "writes beside it (as llama-server's --mmproj; Pixtral, Mistral 3, Gemma 3, Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL)", metavar="FILE")
    # filled by resolve()
    model_config: ModelConfig | None = None
    # the request defaults taken from generation_config.json (generation_config="auto")
    sampling_defaults: Mapping[str, float | int] = field(default_factory=lambda: MappingProxyType({}))
    # CPU: the context length at which a prefill token's attention costs as much as its
    # matmuls; a prefill chunk that starts at context c gets at most budget * L / (L + c)
    # tokens, so a long prompt's late chunks take no longer than its first. None: no cap (CUDA)
    attention_parity_len: int | None = None

    def __post_init__(self) -> None:
        paths = ("model", "download_dir", "tokenizer", "chat_template")
        for name in paths:  # a pathlib.Path, as users pass them, is its string
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("model", "revision", "download_dir", "tokenizer", "chat_template"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                kind = "a non-empty string, a path or None" if name in paths else "a non-empty string or None"
                raise ValueError(f"{name} must be {kind}; got {value!r:.80}")
        for name, (_, choices, optional) in flag_types().items():
            if choices is not None and not (optional and getattr(self, name) is None):
                _choice(name, getattr(self, name), choices)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1; got {self.tensor_parallel_size!r}")
        if self.mixed_graph_max_tokens < 0:
            raise ValueError(f"mixed_graph_max_tokens must be >= 0 (0: mixed steps run eager); got "
                             f"{self.mixed_graph_max_tokens}")
        if self.pooler_config is not None:
            if self.runner == "generate":
                raise ValueError("pooler_config applies to runner='pooling' only: pass runner='pooling' "
                                 "(--runner pooling) too")
            if not isinstance(self.pooler_config, PoolerConfig):
                object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _choice("usage_context", self.usage_context, USAGES)
        object.__setattr__(self, "limit_mm_per_prompt", _mm_limits(self.limit_mm_per_prompt))
        _positive("max_image_pixels", self.max_image_pixels)
        if self.max_num_encoder_input_tokens is not None and (
                not isinstance(self.max_num_encoder_input_tokens, int) or self.max_num_encoder_input_tokens < 1):
            raise ValueError(f"max_num_encoder_input_tokens must be an integer >= 1 (the image tokens a step may "
                             f"start encoding); got {self.max_num_encoder_input_tokens!r}: pass a positive count, "
                             "or leave it unset for max_num_batched_tokens")
        for name, (kind, _, optional) in flag_types().items():  # sizes and counts: None is the default
            if kind is int and optional and getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (auto); got {self.async_scheduling!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def images_per_prompt(self) -> int:
        """The most images one prompt may bring (limit_mm_per_prompt's "image")."""
        return self.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def videos_per_prompt(self) -> int:
        """The most videos one prompt may bring (limit_mm_per_prompt's "video")."""
        return self.limit_mm_per_prompt.get("video", DEFAULT_VIDEOS_PER_PROMPT)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the paged KV cache stores: the model dtype, or float8_e4m3fn."""
        return _KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def __getstate__(self) -> dict:  # to the engine core's process: a mappingproxy does not pickle
        return {**self.__dict__, "sampling_defaults": dict(self.sampling_defaults)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, sampling_defaults=MappingProxyType(state["sampling_defaults"]))

    def resolve(self) -> EngineConfig:
        """Fill every 'auto' and None from the model and the machine; a resolved config (its
        model_config set) is returned as it is."""
        if self.model_config is not None:
            return self
        from ember.loader.model_files import locate_model, locate_tokenizer
        from ember.loader.tokenizer_files import load_chat_template

        files = locate_model(self.model, self.load_format, self.revision, self.download_dir)
        model_config = files.model_config()
        if self.mmproj is not None:
            model_config = _with_mmproj(model_config, files, self.mmproj)
        tokenizer = str(locate_tokenizer(self.tokenizer, self.download_dir)) if self.tokenizer else None
        chat_template = load_chat_template(self.chat_template) if self.chat_template else None
        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device: use device='cpu'")
        if self.tensor_parallel_size > 1:
            from ember.distributed.sharding import shard_heads, split_evenly

            shard_heads(model_config.num_heads, model_config.num_kv_heads, 0, self.tensor_parallel_size)
            if model_config.moe_layers is not None:  # each expert's intermediate rows split among the ranks
                split_evenly(model_config.moe_intermediate_size, 0, self.tensor_parallel_size,
                             "the experts' intermediate size (moe_intermediate_size)")
            if model_config.linear_layers is not None:  # each rank its key heads, with the value heads they serve
                split_evenly(model_config.linear_num_key_heads, 0, self.tensor_parallel_size,
                             "the gated DeltaNet's key heads (linear_num_key_heads)")
        quantization = _quantization(self.quantization, files, device)
        if model_config.moe_layers is not None and quantization == "fp8" and device == "cuda":
            logger.info("%s: quantization='fp8' covers the linear layers, and the experts where an FP8 checkpoint "
                        "holds them so (the fused MoE kernels scale them as they multiply); a dense checkpoint's "
                        "experts stay in the run dtype", model_config.architecture)
        elif model_config.moe_layers is not None and quantization == "fp8":
            logger.info("%s: quantization='fp8' covers the linear layers; the experts' stacked weights stay in the "
                        "run dtype on the CPU (an FP8 checkpoint's are dequantized at load: FP8 experts run on CUDA)",
                        model_config.architecture)
        if self.deterministic and device == "cuda":
            _check_deterministic(model_config, quantization, self.tensor_parallel_size)
        dtype = self.dtype if self.dtype != "auto" else _auto_dtype(device, quantization)
        if device == "cpu" and dtype == "bfloat16" and not cpu_computes_bfloat16():
            logger.warning("dtype=bfloat16 on a CPU without native bfloat16 (AVX512_BF16 or AMX): every op "
                           "converts to and from float32, so this runs slower than dtype=float32")
        runner = _runner(self.runner, model_config, self.tensor_parallel_size, quantization)
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_context:
            raise ValueError(
                f"max_model_len={max_model_len} is longer than the model's context "
                f"({model_config.max_context}): lower max_model_len"
            )
        if device == "cuda" and _KV_CACHE_DTYPES[self.kv_cache_dtype] == torch.float8_e4m3fn \
                and torch.cuda.get_device_capability() < (8, 9):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs a GPU with fp8 (compute capability "
                             f">= 8.9: Ada, Hopper); this one is {torch.cuda.get_device_capability()}: "
                             "use kv_cache_dtype='auto'")
        defaults = scheduling_defaults(device, self.usage_context, images=model_config.vision is not None)
        async_scheduling = self.async_scheduling if self.async_scheduling is not None else device == "cuda"
        if self.preemption_mode != "recompute":
            _check_swap(self.preemption_mode, self.swap_space, model_config, self.speculative_config)
        elif self.swap_space != SWAP_SPACE_GIB:
            raise ValueError(f"swap_space ({self.swap_space!r} GiB) holds the blocks of requests preempted by swap: "
                             "set preemption_mode 'swap' or 'auto' with it, or leave it out")
        if self.kv_offload_gib is not None:  # None: the runner sizes it (defaults.host_tier_default)
            _check_kv_offload(self.kv_offload_gib, self.enable_prefix_caching and runner == "generate", model_config)
        if self.speculative_config is not None and runner != "generate":
            raise ValueError("speculative_config applies to runner='generate' only: a pooling model samples nothing")
        if self.speculative_config is not None and model_config.linear_layers is not None:
            raise ValueError(f"{model_config.architecture}: speculative decoding is not supported for models with "
                             "linear-attention layers yet (their recurrent state cannot roll back rejected drafts): "
                             "leave speculative_config unset")
        if self.speculative_config is not None and self.speculative_config.method in ("draft_model", "eagle3") \
                and model_config.mrope_section is not None:
            raise ValueError(f"speculative decoding by {self.speculative_config.method} is not supported with M-RoPE "
                             "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL) yet: the drafter turns its keys by 1-D positions; use method "
                             "'ngram' or leave speculative_config unset")
        speculative_config = self.speculative_config
        if speculative_config is not None and speculative_config.method == "draft_model":
            speculative_config = _resolve_draft_model(speculative_config, model_config, device, self.download_dir)
        elif speculative_config is not None and speculative_config.method == "eagle3":
            speculative_config = _resolve_eagle3(speculative_config, model_config, self.download_dir)
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        # an encoder runs each prompt in one step: the default budget holds the longest
        max_num_batched_tokens = self.max_num_batched_tokens or max(
            defaults.max_num_batched_tokens, max_model_len if model_config.bidirectional else 0)
        vision = model_config.vision
        if vision is not None and vision.bidirectional_images and max_num_batched_tokens < vision.tokens_per_image:
            raise ValueError(f"{model_config.architecture}: an image's {vision.tokens_per_image} tokens attend to each "
                             f"other both ways, so they run in one step: max_num_batched_tokens="
                             f"{max_num_batched_tokens} must be at least {vision.tokens_per_image}")
        resolved = dataclasses.replace(
            self,
            model=str(files.path),
            tokenizer=tokenizer,
            chat_template=chat_template,
            sampling_defaults=_sampling_defaults(files, self.generation_config, self.override_generation_config),
            load_format=files.load_format,
            device=device,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype="float16" if self.kv_cache_dtype == "auto" and device == "cpu" and quantization == "gguf"
            else self.kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs or defaults.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens or max_num_batched_tokens,
            block_size=self.block_size or (128 if device == "cuda" else 16),
            attention_backend=backend,
            async_scheduling=async_scheduling,
            model_config=model_config,
            runner=runner,
            pooler_config=_pooler_config(self.pooler_config, runner, model_config, files),
            enable_prefix_caching=self.enable_prefix_caching and runner == "generate",
            speculative_config=speculative_config,
            attention_parity_len=None if device == "cuda" else _attention_parity_len(model_config),
        )
        sources = self._sources()
        log_settings(TUNING_KNOBS, vars(resolved), sources, defaults)
        return dataclasses.replace(resolved, setting_sources=sources)

    def _sources(self) -> dict[str, str]:
        """Each tuning knob the caller set: where its value came from (an argument, unless
        setting_sources says "flag" or "config file")."""
        unset = EngineConfig()
        return {name: self.setting_sources.get(name, "argument") for name in TUNING_KNOBS
                if getattr(self, name) != getattr(unset, name)}


def flag_fields() -> list[dataclasses.Field]:
    """EngineConfig's flags (the fields made with `flag`), in field order."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


@functools.cache
def flag_types() -> dict[str, tuple[type, tuple[str, ...] | None, bool]]:
    """Each flag's (value type, choices or None, whether None is allowed), from its annotation."""
    hints = get_type_hints(EngineConfig)
    types = {}
    for f in flag_fields():
        hint = hints[f.name]
        args = get_args(hint) if get_origin(hint) is not Literal else (hint,)
        optional = type(None) in args
        value = next((a for a in args if a is not type(None)), hint)
        choices = get_args(value) if get_origin(value) is Literal else None
        types[f.name] = (str if choices else value, choices, optional)
    return types


# the knobs a tuner turns: logged at start with where each value came from
TUNING_KNOBS = tuple(f.name for f in flag_fields() if f.metadata["knob"])


MODALITIES = ("image", "video")


def _mm_limits(value: str | Mapping[str, int] | None) -> dict[str, int]:
    """limit_mm_per_prompt as a dict from a JSON object, a dict or None (no limits given)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f'limit_mm_per_prompt must be a JSON object such as \'{{"image": 2}}\'; got {value!r:.80}') \
                from None
    if not isinstance(value, Mapping):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object of counts; got {value!r:.80}")
    for kind, count in value.items():
        if kind not in MODALITIES and count != 0:
            raise ValueError(f"limit_mm_per_prompt: ember takes no {kind!r} inputs (only {', '.join(MODALITIES)}): "
                             f"leave it out or set it to 0")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{kind!r}] must be an integer >= 0; got {count!r:.40}")
    return dict(value)


def _check_deterministic(mc: ModelConfig, quantization: str, tensor_parallel_size: int) -> None:
    """What deterministic mode covers on CUDA: one GPU, dense layers in the model dtype."""
    if mc.moe_layers is not None:
        raise ValueError(f"{mc.architecture}: deterministic mode does not cover the mixture-of-experts kernels on "
                         "CUDA yet: leave deterministic off (the CPU runs mixtures of experts batch-invariant)")
    if quantization not in ("none", "gguf"):
        raise ValueError(f"deterministic mode runs the linear layers in the model dtype: use quantization='none' "
                         f"with deterministic=True, or leave deterministic off for {quantization}")
    if tensor_parallel_size > 1:
        raise ValueError("deterministic mode runs on one GPU (an all-reduce's order follows its size): use "
                         "tensor_parallel_size 1, or --data-parallel-size for more GPUs")


def cpu_computes_bfloat16() -> bool:
    """The CPU has bfloat16 arithmetic (AVX512_BF16 or AMX), by the flags Linux lists."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _auto_dtype(device: str, quantization: str) -> str:
    if device == "cuda":
        return "bfloat16"
    from ember.loader.int_checkpoint import INT_METHODS

    if quantization in ("gguf",) + INT_METHODS:  # the block kernels take float32 activations, as llama.cpp's
        return "float32"
    return "bfloat16" if cpu_computes_bfloat16() else "float32"


def _runner(asked: str, model_config: ModelConfig, tensor_parallel_size: int, quantization: str) -> str:
    """The runner: `auto` is pooling for an encoder or a classifier, else generate; neither can generate."""
    if model_config.classifier == "score":  # a decoder with a classification head
        if asked == "generate":
            raise ValueError(f"{model_config.architecture}: this checkpoint is a sequence classifier (a score head, "
                             "no LM head): it classifies, it does not generate text: use runner='pooling' (or auto)")
        return "pooling"
    if not model_config.bidirectional:
        return "generate" if asked == "auto" else asked
    what = f"{model_config.architecture} is an encoder"
    if asked == "generate":
        raise ValueError(f"{what}: it embeds and classifies, it does not generate text: use runner='pooling' "
                         "(--runner pooling, or leave it at auto)")
    if tensor_parallel_size > 1:
        raise ValueError(f"{what}: tensor parallelism does not split encoders: use tensor_parallel_size 1 "
                         "(or --data-parallel-size for replicas)")
    if quantization != "none":
        raise ValueError(f"{what}: quantization={quantization!r} does not apply to encoders: use 'none'")
    return "pooling"


def _pooler_config(asked: PoolerConfig | None, runner: str, model_config: ModelConfig, files) -> PoolerConfig | None:
    """How a pooling engine pools: as asked, else as the checkpoint's sentence-transformers
    files say, else the first token (an encoder) or the last (a decoder), L2-normalized. A
    classification model pools its first token (an encoder's) or its last (a decoder's)
    through its head, unnormalized."""
    if runner != "pooling":
        if asked is not None:
            raise ValueError(f"pooler_config applies to runner='pooling' only, and {model_config.architecture} "
                             "generates: pass runner='pooling' (--runner pooling) too")
        return None
    if model_config.classifier is not None:
        if asked is not None:
            raise ValueError(f"{model_config.architecture}: a sequence-classification model pools one token through "
                             "its classification head; pooler_config does not apply to it: leave it out")
        return PoolerConfig("CLS" if model_config.bidirectional else "LAST", normalize=False)
    if asked is not None:
        return asked
    return files.pooler_defaults() or PoolerConfig("CLS" if model_config.bidirectional else "LAST")


def _resolve_draft_model(spec: SpeculativeConfig, target: ModelConfig, device: str,
                         download_dir: str | None) -> SpeculativeConfig:
    """A draft model's files, config and weight format, checked against the target's."""
    from ember.loader.model_files import locate_model

    files = locate_model(spec.model, "auto", None, download_dir)
    draft = files.model_config()
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary has {draft.vocab_size} tokens and the "
                         f"target's {target.vocab_size}: a draft model must share the target's tokenizer")
    if target.layer_windows and all(w is not None for w in target.layer_windows):
        raise ValueError(f"speculative_config: {target.architecture} has a sliding window on every layer, so the pool "
                         "gives back blocks no window reaches, which a draft model may still read: use method 'ngram'")
    if draft.linear_layers is not None or draft.bidirectional:
        raise ValueError(f"speculative_config: {draft.architecture} cannot draft (linear-attention layers or an "
                         "encoder): choose a decoder with attention layers only")
    return dataclasses.replace(spec, model=str(files.path), draft_model_config=draft,
                              draft_quantization=_quantization("auto", files, device))


def _check_swap(mode: str, gib: float, mc: ModelConfig, spec) -> None:
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < 1 << 20:
        raise ValueError(f"swap_space must be a number of GiB > 0 for preemption_mode {mode!r}; got {gib!r}")
    if (mc.layer_windows is not None and any(w is not None for w in mc.layer_windows)) or mc.linear_layers is not None:
        raise ValueError(f"preemption_mode {mode!r} is not supported for {mc.architecture}'s sliding-window or "
                         "linear-attention layers yet: use recompute")
    if spec is not None and spec.method == "eagle3":  # (a draft model's cache is swapped with the target's)
        raise ValueError(f"preemption_mode {mode!r} does not keep an EAGLE-3 head's pending features of a swapped-out "
                         "request yet: use recompute with an EAGLE-3 head")


def _check_kv_offload(gib: float, prefix_caching: bool, mc: ModelConfig) -> None:
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 <= gib < 1 << 20:
        raise ValueError(f"kv_offload_gib must be a number of GiB >= 0; got {gib!r}")
    refused = kv_offload_refusal(prefix_caching, mc)
    if gib and refused is not None:
        raise ValueError(f"kv_offload_gib {refused}: leave it 0 (or unset)")


def kv_offload_refusal(prefix_caching: bool, mc: ModelConfig) -> str | None:
    """Why this engine cannot keep a host tier (what follows "kv_offload_gib" or "the tier" in a
    sentence), None where it can."""
    if not prefix_caching:
        return ("keeps the blocks the prefix cache evicts: it needs the prefix cache (enable_prefix_caching, "
                "a generating model)")
    if mc.layer_windows is not None and any(w is not None for w in mc.layer_windows):
        return (f"is not supported for {mc.architecture}'s sliding-window layers yet (their cache gives back "
                "blocks a window passed)")
    if mc.linear_layers is not None:
        return (f"is not supported for {mc.architecture}'s linear-attention layers yet (a hit also needs their "
                "recurrent state)")
    return None


def _resolve_eagle3(spec: SpeculativeConfig, target: ModelConfig, download_dir: str | None) -> SpeculativeConfig:
    """An EAGLE-3 head's files and config, checked against the target's."""
    from ember.loader.model_files import locate_model
    from ember.loader.safetensors import tensor_names
    from ember.models.eagle3 import Eagle3Config

    files = locate_model(spec.model, "auto", None, download_dir)
    if files.is_gguf:
        raise ValueError("speculative_config: an EAGLE-3 head is an HF directory (config.json and safetensors or "
                         "pytorch_model.bin), not a .gguf file")
    head = Eagle3Config.from_dir(files.path, tensor_names(files.path, files.load_format))
    what = f"speculative_config: the EAGLE-3 head at {files.path}"
    if head.layer.vocab_size != target.vocab_size:
        raise ValueError(f"{what} is for a vocabulary of {head.layer.vocab_size} tokens and the target's has "
                         f"{target.vocab_size}: use a head trained for this target")
    if head.target_hidden_size != target.hidden_size or (not head.has_embedding
                                                         and head.layer.hidden_size != target.hidden_size):
        raise ValueError(f"{what} reads hidden states of {head.target_hidden_size} and the target's are "
                         f"{target.hidden_size}: use a head trained for this target")
    layers = head.aux_layer_ids or ()
    if len(layers) not in (0, 3) or len(set(layers)) != len(layers) \
            or any(not 0 <= i < target.num_layers for i in layers):
        raise ValueError(f"{what} names target layers {list(layers)} (eagle_aux_hidden_state_layer_ids): an "
                         f"EAGLE-3 head reads 3 distinct layers of the target's {target.num_layers}")
    if not layers and target.num_layers < 4:
        raise ValueError(f"{what} names no target layers and {target.architecture} has {target.num_layers}: the "
                         "default (2, L/2, L-3) needs 4 or more; set eagle_aux_hidden_state_layer_ids in its config")
    if target.mla or target.bidirectional or target.layer_norm:
        raise ValueError(f"speculative_config: EAGLE-3 heads are for decoders of RMSNorm'd attention layers; "
                         f"{target.architecture} is not one: use method 'ngram' or 'draft_model'")
    if target.layer_windows and all(w is not None for w in target.layer_windows):
        raise ValueError(f"speculative_config: {target.architecture} has a sliding window on every layer, so the pool "
                         "gives back blocks no window reaches, which the head may still read: use method 'ngram'")
    return dataclasses.replace(spec, model=str(files.path), eagle3_config=head)


def _with_mmproj(model_config: ModelConfig, files, mmproj: str) -> ModelConfig:
    """A GGUF model's config with the image side its mmproj file gives (loader/mmproj.py)."""
    from ember.loader.mmproj import mmproj_vision_config

    if not files.is_gguf:
        raise ValueError(f"--mmproj goes with a GGUF model; {files.path} is an HF directory, whose config.json has its "
                         "image side already: leave --mmproj out")
    if not Path(mmproj).is_file():
        raise ValueError(f"--mmproj {mmproj}: no such file")
    return dataclasses.replace(model_config, vision=mmproj_vision_config(mmproj, model_config, files.gguf_metadata()))


def _quantization(asked: str, files, device: str) -> str:
    """What multiplies the weights: gguf (blocks kept: CPU kernels, Triton's on CUDA), fp8 (FP8 weights), awq /
    gptq / compressed-tensors (integer weights kept) or none (dequantized)."""
    from ember.loader.int_checkpoint import INT_METHODS, IntScheme

    if asked == "fp8" and files.is_gguf:
        raise ValueError("quantization='fp8' quantizes an HF checkpoint's linear layers, and a GGUF file keeps "
                         "its own blocks: use quantization='auto' (GGUF blocks on the CPU) or 'none', or pass the "
                         "model's HF directory (config.json + safetensors) with quantization='fp8'")
    if not files.is_gguf:
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs a .gguf model file")
        scheme = files.quantization_scheme()  # a method ember does not run raises here
        if asked in INT_METHODS or isinstance(scheme, IntScheme):
            return _int_quantization(asked, scheme, files)
        return _fp8_quantization(asked, files, device)
    if asked in INT_METHODS:
        raise ValueError(f"quantization={asked!r} reads an HF checkpoint quantized so; a GGUF file keeps its own "
                         "blocks: use quantization='auto' or 'none'")
    if asked == "none" or files.load_format == "dummy":
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs a .gguf model file's own weights, and load_format='dummy' "
                             "makes dense random ones: use quantization='auto'")
        return "none"
    if device != "cpu":  # the Triton kernels of kernels/gguf.py
        return "gguf"
    from ember.kernels import cpu

    if cpu.ops() is None:
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs ember's CPU kernels, which did not build (see the warning "
                             "above): install a C++ compiler, or use quantization='none'")
        logger.warning("the CPU kernels did not build: the GGUF weights are dequantized to the run dtype")
        return "none"
    return "gguf"


def _int_quantization(asked: str, scheme, files) -> str:
    """An AWQ / GPTQ / compressed-tensors checkpoint's method (its integer weights kept), or
    none (dequantized at load); a method named that is not the checkpoint's is refused."""
    from ember.loader.int_checkpoint import IntScheme

    if not isinstance(scheme, IntScheme):
        has = "no quantization_config" if scheme is None else f"an fp8 quantization_config ({scheme.method})"
        raise ValueError(f"quantization={asked!r} reads a checkpoint quantized so, and {files.path}'s config.json "
                         f"has {has}: use quantization='auto'")
    method = scheme.method
    if asked == "none":
        logger.info("%s: %s checkpoint dequantized to the run dtype (quantization='none')", files.path, method)
        return "none"
    if asked not in ("auto", method):
        raise ValueError(f"quantization={asked!r} does not fit {files.path}: its config.json's quantization_config "
                         f"is {method!r}: use quantization='auto' (or {method!r}), or 'none' to dequantize it")
    if files.load_format == "dummy":
        logger.info("%s: dummy weights quantized at load as the checkpoint's %s scheme (round to nearest)",
                    files.path, method)
    return method


def _fp8_quantization(asked: str, files, device: str) -> str:
    """fp8 or none for an HF directory: asked for, or auto on an FP8 checkpoint on CUDA."""
    scheme = files.quantization_scheme()  # a method ember does not run raises here
    if asked == "none" or (asked == "auto" and scheme is None):
        if scheme is not None:
            logger.info("%s: FP8 checkpoint dequantized to the run dtype (quantization='none')", files.path)
        return "none"
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        if asked == "fp8":
            raise ValueError(f"quantization='fp8' needs a GPU with fp8 (compute capability >= 8.9: Ada, Hopper); "
                             f"this one is {torch.cuda.get_device_capability()}: use quantization='none'")
        logger.info("%s: FP8 checkpoint dequantized to the run dtype: this GPU has no fp8 (compute capability %s "
                    "< 8.9)", files.path, torch.cuda.get_device_capability())
        return "none"
    if device == "cpu":
        if asked == "auto":
            logger.info("%s: FP8 checkpoint dequantized to the run dtype on the CPU (quantization='fp8' keeps the "
                        "fp8 weights and dequantizes them at every matmul)", files.path)
            return "none"
        logger.warning("quantization='fp8' on the CPU: the fp8 weights are dequantized at every matmul (a reference "
                       "path, slower than quantization='none'); the FP8 kernels run on CUDA")
    return "fp8"


OVERRIDABLE_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                        "frequency_penalty")


def _sampling_defaults(files, generation_config: str, override: str | Mapping | None = None) -> Mapping[str, float | int]:
    """generation_config.json's sampling fields (with generation_config "auto") under the
    override's, checked once here (a bad value would fail every request that leaves it
    unset), and logged."""
    from ember.sampling_params import SamplingParams

    defaults = {} if generation_config == "vllm" else files.sampling_defaults()
    if defaults:
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"{files.path / 'generation_config.json'}: {e}: fix the file, or pass "
                             "generation_config='vllm' (--generation-config vllm) to ignore it") from None
        logger.info("default sampling params from generation_config.json: %s (--generation-config vllm "
                    "turns them off)", defaults)
    if override is not None:
        try:
            given = json.loads(override) if isinstance(override, str) else dict(override)
        except (ValueError, TypeError) as e:
            raise ValueError(f"override_generation_config must be a JSON object; {e}") from None
        unknown = sorted(set(given) - set(OVERRIDABLE_DEFAULTS)) if isinstance(given, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"override_generation_config takes an object of {', '.join(OVERRIDABLE_DEFAULTS)}; got "
                             f"{', '.join(unknown) if unknown else type(given).__name__}")
        try:
            SamplingParams(**given)
        except ValueError as e:
            raise ValueError(f"override_generation_config: {e}") from None
        defaults = defaults | given
        logger.info("default sampling params with --override-generation-config: %s", defaults)
    return MappingProxyType(defaults)


def _attention_parity_len(mc: ModelConfig) -> int:
    """Matmul FLOPs of a token (2 x the weights of a layer) over its attention FLOPs per
    context position (QK and PV: 4 x heads x head_dim): ~3,072 for SmolLM2-135M, where a
    512-token chunk measured 2.0 s at context 0 and 7.5 s at 7,500."""
    q = mc.num_heads * mc.head_dim
    kv = mc.num_kv_heads * mc.head_dim
    weights = mc.hidden_size * (2 * q + 2 * kv) + 3 * mc.hidden_size * mc.intermediate_size
    return max(1, weights // (2 * q))


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
