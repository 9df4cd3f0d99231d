"""EngineConfig: user flags (vLLM's names), validated, and `resolve()`: the one place where
flags + model + hardware become the numbers every part uses. Frozen; never mutated."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ember.defaults import TUNING_KNOBS, USAGES, log_settings, scheduling_defaults
from ember.models.config import ModelConfig
from ember.pooling import PoolerConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype: auto stores K/V in the model dtype; fp8 (= fp8_e4m3) in float8_e4m3fn
_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CPU_KV_CACHE_MEMORY = 1 << 30  # default KV pool on the CPU: 1 GiB (vLLM's CPU backend uses 4)


@dataclass(frozen=True)
class EngineConfig:
    # a .gguf file, an HF directory (a str or any os.PathLike), or a Hugging Face Hub id
    # (org/name, org/name-GGUF:Q4_K_M); None: the default SmolLM2 GGUF. resolve() makes it a local path.
    model: str | None = None
    revision: str | None = None  # hub ids: a branch, tag or commit hash (default: main)
    download_dir: str | None = None  # hub ids: the cache folder (default: huggingface_hub's, HF_HUB_CACHE)
    tokenizer: str | None = None  # a directory, .gguf or hub id; None: the model's own
    chat_template: str | None = None  # a file or the Jinja text itself; None: the tokenizer's. resolve(): the text
    # auto: sampling fields that generation_config.json sets are the defaults of requests that
    # leave them unset (vLLM's default); vllm: ember's own defaults (SamplingParams)
    generation_config: str = "auto"
    load_format: str = "auto"  # auto | gguf | safetensors | pt (pytorch_model*.bin) | dummy
    # auto: bfloat16 on CUDA; on the CPU float32 for GGUF blocks (the kernels take float32
    # activations, as llama.cpp's do), else bfloat16 where the CPU computes it natively
    # (AVX512_BF16, AMX) and float32 elsewhere | float32 | bfloat16 | float16
    dtype: str = "auto"
    # auto: weights as the checkpoint holds them, where a kernel multiplies them (GGUF blocks
    # on the CPU, an FP8 checkpoint on CUDA), else dequantized to dtype | none: every weight
    # dequantized to dtype | fp8: every linear layer in FP8 (an FP8 checkpoint's own scales;
    # a dense checkpoint or dummy weights quantized per output row at load; the LM head and
    # the embedding stay in dtype). resolve() names what runs: gguf | fp8 | none
    quantization: str = "auto"
    # auto: = dtype, but float16 with GGUF blocks on the CPU (llama.cpp's default cache type: a
    # batch's decode reads as many KV bytes as weight bytes there) | float32 | float16 |
    # bfloat16 | fp8 | fp8_e4m3 (per-layer scales, 1.0 by default)
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # default: the model's context length
    # tokens a KV block; None: 128 on CUDA (an attention tile is then one block: one block-table
    # read a tile, 16-20 % faster decode over fp8 on the H200), 16 on the CPU
    block_size: int | None = None
    num_kv_blocks: int | None = None  # overrides the pool size (vLLM's num_gpu_blocks_override)
    kv_cache_memory: int | None = None  # bytes for the KV pool
    gpu_memory_utilization: float = 0.9
    # seats and per-step token budget; None: the defaults for the device and usage_context
    # (defaults.py: e.g. 512 and 16384 offline on a large GPU, 256 and 512 on the CPU)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    usage_context: str = "offline"  # offline (LLM, ember bench) | serve (ember serve): picks the defaults above
    # knob -> where the caller took its value ("flag", "config file"); logged at start. After
    # resolve(): the knobs the caller set, and only those (the others took the defaults)
    setting_sources: dict[str, str] = field(default_factory=dict)
    scheduling_policy: str = "fcfs"  # fcfs | priority | lpm (longest cached prefix first)
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False
    attention_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere) | torch | triton
    structured_outputs_backend: str = "xgrammar"  # xgrammar | guidance
    structured_outputs_jump_forward: bool = True  # append grammar-forced tokens without a forward each
    # schedule and prepare step N+1 while step N runs on the device (vLLM's flag);
    # None: on for CUDA, off on the CPU (where torch runs synchronously: nothing to overlap)
    async_scheduling: bool | None = None
    # generate: sample tokens | pooling: each request's prompt becomes one pooled vector of
    # its final hidden states (embeddings), as `pooler_config` says; no sampling, no prefix
    # cache (a hit would skip positions that mean pooling reads). vLLM's --runner
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None  # runner="pooling" only; None: PoolerConfig() (last token, normalized)
    # ranks the model's layers are split over (Megatron: heads, MLP rows, vocabulary), one
    # worker process each (runner/tensor_parallel.py): gloo on the CPU, NCCL on GPUs 0..N-1
    tensor_parallel_size: int = 1
    # mp: the workers are processes of this machine | ray: Ray actors, on the cluster RAY_ADDRESS
    # names (or a new local one), placed by a placement group: ranks may span nodes | None: mp
    # when tensor_parallel_size > 1, else the model runs in the engine's process (named at
    # size 1, mp or ray still runs the one rank as a worker, as vLLM's executors do)
    distributed_executor_backend: str | None = None
    # tensor parallelism on GPUs of one host: a decode step's all-reduces (up to 8 MiB) go
    # through the GPUs' mapped memory in one kernel (distributed/peer_all_reduce.py); True
    # leaves them all to NCCL (vLLM's flag)
    disable_custom_all_reduce: bool = False
    # batch invariance everywhere (layers/batch_invariant.py): on CUDA every linear layer on one
    # Triton matmul whose order of arithmetic is the same at any row count, and decode rows
    # through the prefill attention kernel; on the CPU dense layers in fixed blocks of rows. The
    # CPU's GGUF blocks are invariant without it. Costs speed (benchmarks/BENCHMARKS.md)
    deterministic: bool = False
    # filled by resolve()
    model_config: ModelConfig | None = None
    # the request defaults taken from generation_config.json (generation_config="auto")
    sampling_defaults: Mapping[str, float | int] = field(default_factory=lambda: MappingProxyType({}))
    # CPU: the context length at which a prefill token's attention costs as much as its
    # matmuls; a prefill chunk that starts at context c gets at most budget * L / (L + c)
    # tokens, so a long prompt's late chunks take no longer than its first. None: no cap (CUDA)
    attention_parity_len: int | None = None

    def __post_init__(self) -> None:
        _choice("load_format", self.load_format, ("auto", "gguf", "safetensors", "pt", "dummy"))
        _choice("generation_config", self.generation_config, ("auto", "vllm"))
        paths = ("model", "download_dir", "tokenizer", "chat_template")
        for name in paths:  # a pathlib.Path, as users pass them, is its string
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("model", "revision", "download_dir", "tokenizer", "chat_template"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                kind = "a non-empty string, a path or None" if name in paths else "a non-empty string or None"
                raise ValueError(f"{name} must be {kind}; got {value!r:.80}")
        _choice("dtype", self.dtype, ("auto", *_DTYPES))
        _choice("quantization", self.quantization, ("auto", "none", "gguf", "fp8"))
        if self.distributed_executor_backend is not None:
            _choice("distributed_executor_backend", self.distributed_executor_backend, ("mp", "ray"))
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1; got {self.tensor_parallel_size!r}")
        _choice("kv_cache_dtype", self.kv_cache_dtype, tuple(_KV_CACHE_DTYPES))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority", "lpm"))
        _choice("structured_outputs_backend", self.structured_outputs_backend, ("xgrammar", "guidance"))
        _choice("runner", self.runner, ("generate", "pooling"))
        if self.pooler_config is not None:
            if self.runner != "pooling":
                raise ValueError("pooler_config applies to runner='pooling' only: pass runner='pooling' "
                                 "(--runner pooling) too")
            if not isinstance(self.pooler_config, PoolerConfig):
                object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        _choice("usage_context", self.usage_context, USAGES)
        for name in ("max_num_seqs", "block_size", "max_model_len", "num_kv_blocks", "kv_cache_memory", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (auto); got {self.async_scheduling!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

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
        """Fill every 'auto' and None from the model and the machine."""
        from ember.loader.model_files import locate_model, locate_tokenizer
        from ember.loader.tokenizer_files import load_chat_template

        files = locate_model(self.model, self.load_format, self.revision, self.download_dir)
        model_config = files.model_config()
        tokenizer = str(locate_tokenizer(self.tokenizer, self.download_dir)) if self.tokenizer else None
        chat_template = load_chat_template(self.chat_template) if self.chat_template else None
        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device: use device='cpu'")
        if self.tensor_parallel_size > 1:
            from ember.distributed.sharding import shard_heads

            if model_config.moe_layers is not None:
                raise ValueError(f"{model_config.architecture}: tensor parallelism does not split mixtures of "
                                 "experts yet: use tensor_parallel_size 1 (or --data-parallel-size for replicas)")
            shard_heads(model_config.num_heads, model_config.num_kv_heads, 0, self.tensor_parallel_size)
        quantization = _quantization(self.quantization, files, device)
        if model_config.moe_layers is not None and quantization == "fp8":
            raise ValueError(f"{model_config.architecture}: quantization='fp8' does not cover the experts' stacked "
                             "weights yet: use quantization='none' (or 'auto')")
        if self.deterministic and device == "cuda":
            _check_deterministic(model_config, quantization, self.tensor_parallel_size)
        dtype = self.dtype if self.dtype != "auto" else _auto_dtype(device, quantization)
        if device == "cpu" and dtype == "bfloat16" and not cpu_computes_bfloat16():
            logger.warning("dtype=bfloat16 on a CPU without native bfloat16 (AVX512_BF16 or AMX): every op "
                           "converts to and from float32, so this runs slower than dtype=float32")
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
        defaults = scheduling_defaults(device, self.usage_context)
        async_scheduling = self.async_scheduling if self.async_scheduling is not None else device == "cuda"
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        resolved = dataclasses.replace(
            self,
            model=str(files.path),
            tokenizer=tokenizer,
            chat_template=chat_template,
            sampling_defaults=_sampling_defaults(files, self.generation_config),
            load_format=files.load_format,
            device=device,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype="float16" if self.kv_cache_dtype == "auto" and device == "cpu" and quantization == "gguf"
            else self.kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs or defaults.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or defaults.max_num_batched_tokens,
            block_size=self.block_size or (128 if device == "cuda" else 16),
            attention_backend=backend,
            async_scheduling=async_scheduling,
            model_config=model_config,
            pooler_config=self.pooler_config or (PoolerConfig() if self.runner == "pooling" else None),
            enable_prefix_caching=self.enable_prefix_caching and self.runner == "generate",
            attention_parity_len=None if device == "cuda" else _attention_parity_len(model_config),
        )
        sources = self._sources()
        log_settings(vars(resolved), sources, defaults)
        return dataclasses.replace(resolved, setting_sources=sources)

    def _sources(self) -> dict[str, str]:
        """Each tuning knob the caller set: where its value came from (an argument, unless
        setting_sources says "flag" or "config file")."""
        unset = EngineConfig()
        return {name: self.setting_sources.get(name, "argument") for name in TUNING_KNOBS
                if getattr(self, name) != getattr(unset, name)}


def _check_deterministic(mc: ModelConfig, quantization: str, tensor_parallel_size: int) -> None:
    """What deterministic mode covers on CUDA: one GPU, dense layers in the model dtype."""
    if mc.moe_layers is not None:
        raise ValueError(f"{mc.architecture}: deterministic mode does not cover the mixture-of-experts kernels on "
                         "CUDA yet: leave deterministic off (the CPU runs mixtures of experts batch-invariant)")
    if quantization == "fp8":
        raise ValueError("deterministic mode runs the linear layers in the model dtype: use quantization='none' "
                         "with deterministic=True, or leave deterministic off for FP8")
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
    if quantization == "gguf":
        return "float32"
    return "bfloat16" if cpu_computes_bfloat16() else "float32"


def _quantization(asked: str, files, device: str) -> str:
    """What multiplies the weights: gguf (blocks kept, CPU kernels), fp8 (FP8 weights) or
    none (dequantized)."""
    if asked == "fp8" and files.is_gguf:
        raise ValueError("quantization='fp8' quantizes an HF checkpoint's linear layers, and a GGUF file keeps "
                         "its own blocks: use quantization='auto' (GGUF blocks on the CPU) or 'none', or pass the "
                         "model's HF directory (config.json + safetensors) with quantization='fp8'")
    if not files.is_gguf:
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs a .gguf model file")
        return _fp8_quantization(asked, files, device)
    if asked == "none" or files.load_format == "dummy":
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs a .gguf model file's own weights, and load_format='dummy' "
                             "makes dense random ones: use quantization='auto'")
        return "none"
    if device != "cpu":
        if asked == "gguf":
            raise ValueError("quantization='gguf' runs on the CPU only: use device='cpu', or quantization='auto' "
                             "to dequantize the file for the GPU")
        return "none"
    from ember.kernels import cpu

    if cpu.ops() is None:
        if asked == "gguf":
            raise ValueError("quantization='gguf' needs ember's CPU kernels, which did not build (see the warning "
                             "above): install a C++ compiler, or use quantization='none'")
        logger.warning("the CPU kernels did not build: the GGUF weights are dequantized to the run dtype")
        return "none"
    return "gguf"


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


def _sampling_defaults(files, generation_config: str) -> Mapping[str, float | int]:
    """generation_config.json's sampling fields, checked once here (a bad value would fail
    every request that leaves it unset), and logged."""
    from ember.sampling_params import SamplingParams

    if generation_config == "vllm":
        return MappingProxyType({})
    defaults = files.sampling_defaults()
    if defaults:
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"{files.path / 'generation_config.json'}: {e}: fix the file, or pass "
                             "generation_config='vllm' (--generation-config vllm) to ignore it") from None
        logger.info("default sampling params from generation_config.json: %s (--generation-config vllm "
                    "turns them off)", defaults)
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
