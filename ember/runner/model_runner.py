"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into one
forward pass and the sampled tokens.

`launch(plan)` queues the step on the device and returns a LaunchedStep without waiting
for it: the sampled ids stay in a device tensor and travel to pinned host memory behind
an event. `collect(step)` waits for that event and hands the ids back. Between the two
the engine may schedule and launch the next step (async scheduling): a request whose last
token is still pending gets its input id on the device, gathered from the previous
launched step's sampled ids, never through the CPU."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ember.config import CPU_KV_CACHE_MEMORY, EngineConfig, kv_offload_refusal
from ember.defaults import engines_on_host, host_memory_bytes, host_tier_default, seats_that_fit
from ember.distributed.parallel_state import min_over_ranks
from ember.layers.attention import AttentionMetadata
from ember.layers.batch_invariant import make_batch_invariant
from ember.layers.quant import model_weight_bytes
from ember.layers.quant.unquantized import cpu_packing_supported
from ember.layers.transfer import to_device
from ember.loader.model_files import load_model, load_vision_model, locate_model
from ember.models.config import ModelConfig
from ember.request import Request
from ember.runner.cuda_graph import DecodeGraphs, PiecewiseGraphs
from ember.runner.draft_model import DraftCache, DraftModel
from ember.runner.eagle3 import Eagle3Drafter
from ember.runner.kv_copies import IssuedCopies, KVCopies, copy_blocks
from ember.runner.kv_heads import rank_kv_heads
from ember.runner.mrope import MRopePositions
from ember.runner.multimodal import ImageEmbedder, image_key_ends
from ember.runner.pooler import Pooler
from ember.runner.recurrent_state import RecurrentStates
from ember.runner.sampler import (
    LogitBias,
    PendingLogprobs,
    Sampler,
    SamplingRow,
    TokenLogprobs,
    edits_logits,
    to_host,
    token_logprobs,
)
from ember.runner.tower_graphs import tower_graphs
from ember.sampling_params import SamplingParams
from ember.scheduler.scheduler import SchedulerOutput
from ember.scheduler.sliding_window import shared_window

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobs:
    first_position: int  # the prompt position of tokens[0]
    tokens: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # n tokens when a request forks
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one a sampled row (drafts: K + 1)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its token is void (see launch)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # runner="pooling": prompts that ended
    kv_load_seconds: float | None = None  # how long its KV copies in from host memory took, where it had any


@dataclass
class LaunchedStep:
    """A step queued on the device, until `collect`."""

    plan: SchedulerOutput
    owners: list[tuple[Request, int]] = field(default_factory=list)  # (request, sample index) of each sampled row
    tokens: torch.Tensor | None = None  # [rows] int64 on the device: the sampled ids
    rows: dict[str, int] = field(default_factory=dict)  # request id -> its (first) row in `tokens`
    host_tokens: torch.Tensor | None = None  # `tokens` copied to the CPU, complete once `ready` has passed
    ready: torch.cuda.Event | None = None  # None on the CPU, where torch has finished by the time it returns
    # copied to the CPU like host_tokens, unpacked by `collect`: (the rows' request ids, their logprobs)
    logprobs: tuple[list[str], PendingLogprobs] | None = None
    prompt_logprobs: dict[str, tuple[int, PendingLogprobs]] = field(default_factory=dict)  # id -> (first position, ...)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why: its sampling row could not be built
    host_invalid: torch.Tensor | None = None  # SamplerOutput.invalid copied to the CPU like host_tokens
    pooled: tuple[list[str], torch.Tensor] | None = None  # (request ids, their vectors) copied like host_tokens
    copies: IssuedCopies | None = None  # its KV copies to and from host memory (kv_copies.py)


@dataclass
class _Rows:
    start: int
    stop: int
    offset: int  # row - position


def _num_kv_layers(mc: ModelConfig) -> int:
    """Layers whose K/V the pool holds: none for an encoder (nothing outlives its step), the
    attention layers alone beside linear-attention ones (their state: runner/recurrent_state.py)."""
    return 0 if mc.bidirectional else mc.num_attention_layers


def _mask_at(mask: torch.Tensor | None, position: int) -> torch.Tensor | None:
    """A request's grammar mask for its sampled row at `position` in its drafts: a verifying
    chunk has one a position ([K + 1, words]), any other one ([words])."""
    return mask[position] if mask is not None and mask.dim() == 2 else mask


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_GREEDY = SamplingParams(temperature=0)  # the stand-in row of a request whose own row failed
_ARGMAX = SamplingRow(_GREEDY, None, [], [], frozenset())  # a drafting row that takes the raw argmax
VERIFY_GRAPH_MAX_ROWS = 512  # vLLM's largest captured size with speculative decoding


def decode_graph_rows(config: EngineConfig) -> int:
    """The target's decode graphs' largest batch: max_num_seqs rows, and with speculative decoding
    enough for a step verifying K drafts of each request (K + 1 rows a request, as decode rows), up
    to 512 rows and max_num_batched_tokens; a larger verify step runs the piecewise graphs."""
    spec = config.speculative_config
    if spec is None:
        return config.max_num_seqs
    rows = min(config.max_num_seqs * (spec.num_speculative_tokens + 1), VERIFY_GRAPH_MAX_ROWS,
               config.max_num_batched_tokens)
    return max(rows, config.max_num_seqs)


GRAPH_POOL_RESERVE = 512 << 20  # kept out of the KV pool for the decode graphs' memory (logged as measured)
# of the cache memory, what recurrent-state snapshots get by default (the KV pool the rest): one
# snapshot of Qwen3-Next-80B's 36 linear layers is 74 MiB, the KV of ~3,000 tokens of its 12
# attention layers, so a cached prefix of a few thousand tokens costs about as much in each
STATE_SNAPSHOT_SHARE = 0.25


def _raw_argmax(req: Request, num_drafts: int) -> bool:
    """Whether each of a request's next `num_drafts` drafts is the raw argmax of the drafter's
    logits: greedy, and the sampler edits none of them (its drafting rows have no grammar mask)."""
    row = SamplingRow(req.sampling_params, None, req.prompt_token_ids, req.output_token_ids, req.eos_token_ids)
    return req.sampling_params.greedy and not edits_logits(row, num_drafts)


def _return_freed_heap() -> None:
    """glibc keeps freed tensors of a few MB (a layer's weight) on its heap: hand the memory
    back to the system (malloc_trim), for whoever the engine sleeps for."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU from calloc'd pages (numpy's zeros), which the kernel hands out
    zeroed as they are first touched: a 1 GiB pool costs nothing until blocks are used, where
    torch.zeros writes all of it at start (0.3 s)."""
    if device.type != "cpu" or not math.prod(shape):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model_config
        files = locate_model(config.model, config.load_format)
        self.model = self._load_model(files)
        self.images = self._image_embedder(files)  # a vision-language model's image side, else None
        # M-RoPE (Qwen2-VL): each request's (t, h, w) positions (a Qwen-VL GGUF without its mmproj: text
        # alone, whose three positions are equal)
        self.mrope = MRopePositions(mc.vision.merge_size) if mc.mrope_section is not None and mc.vision else None
        # Gemma 3: image tokens see their whole image (the steps over images carry key_ends)
        self.bidirectional_images = mc.vision is not None and mc.vision.bidirectional_images
        spec = config.speculative_config
        self.drafter: DraftCache | None = None  # speculative decoding's draft model or EAGLE-3 head
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(config)
        elif spec is not None and spec.method == "eagle3":
            self.drafter = Eagle3Drafter(config, self.model)
        self.states = self._recurrent_states() if mc.linear_layers is not None else None
        config = self.config  # max_num_seqs may be lowered to fit the recurrent states
        self.weight_bytes = model_weight_bytes(self.model) + (self.drafter.weight_bytes if self.drafter else 0)
        self.file_tensor_bytes = files.tensor_bytes()
        self.activation_bytes = self._profile_activations() if self.device.type == "cuda" else 0
        self.encoder = mc.bidirectional  # whole prompts, no KV cache, no decode step to capture
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and not self.encoder
        self.graph_reserve = GRAPH_POOL_RESERVE if use_graphs else 0
        # the vision tower's graphs: a fixed-shape tower's captured now (the KV pool sees their memory as
        # used), a packed tower's bytes kept out of the KV pool for its captures later (runner/tower_graphs.py)
        self.tower_graph_reserve = 0
        if use_graphs and self.images is not None:
            self.images.graphs, self.tower_graph_reserve = tower_graphs(
                self.images.vision, config.max_num_encoder_input_tokens, next(self.images.vision.parameters()).dtype,
                self.device)
        # when every layer has a window, the scheduler gives back blocks no window reaches and
        # their table entries point at one block past the pool (BlockPool.null_block)
        self.num_null_blocks = 0 if shared_window(mc.layer_windows) is None else 1
        memory = self._cache_memory()
        self.num_state_snapshots = 0
        if self.states is not None and config.enable_prefix_caching:  # a share of the cache memory, first
            memory -= self._keep_state_snapshots(memory)
        self.num_blocks = self._num_kv_blocks(memory)
        if "max_num_seqs" not in config.setting_sources:
            seats = seats_that_fit(config.max_num_seqs, self.num_blocks * config.block_size, config.max_model_len)
            if seats < config.max_num_seqs:
                logger.info("max_num_seqs %d, not the default %d: the KV pool holds %d sequences of max_model_len "
                            "%d", seats, config.max_num_seqs, seats, config.max_model_len)
                self.config = config = dataclasses.replace(config, max_num_seqs=seats)
                if self.states is not None:  # a slot a seat
                    self.states = self._recurrent_states()
                    self.states.keep_snapshots(self.num_state_snapshots)
        # K and V planes (MLA: one, the latent), then layers, blocks, slots, heads, dims
        shape = (mc.kv_planes, self.num_kv_layers, self.num_blocks + self.num_null_blocks, config.block_size,
                 self.num_kv_heads, mc.cache_head_dim)
        # zeroed: padded block-table entries and the null block are read (then masked), never NaN
        self.kv_cache = _zeros(shape, config.kv_cache_torch_dtype, self.device)
        self._attach_kv_cache()
        # the host tier (scheduler/host_tier.py) and preemption by swap (scheduler/swap_space.py): host
        # slots of a block each, and their copies (on CUDA on a copy stream: kv_copies.py)
        block = max(self.kv_bytes_per_block(), 1)
        self.num_host_blocks = int(self._host_tier_gib(block) * 2**30) // block
        self.num_swap_blocks = int(config.swap_space * 2**30) // block if config.preemption_mode != "recompute" else 0
        if self.drafter is not None:  # its own cache over the same block ids
            self.drafter.allocate_cache(self.num_blocks + self.num_null_blocks)
        self.kv_copies = KVCopies(self.kv_caches(), self.num_host_blocks, self.num_swap_blocks)
        self.sampler = Sampler(config.seed)
        if config.runner == "generate":
            self.sampler.warm_up(mc.vocab_size, config.max_num_seqs, config.torch_dtype, self.device)
        self.pooler = Pooler(config.pooler_config) if config.runner == "pooling" else None
        self.pin = self.device.type == "cuda"  # host tensors bound for the device are pinned: copies don't wait
        self.last_launched: LaunchedStep | None = None  # where a pending input id is gathered from
        self.generators: dict[str, torch.Generator] = {}
        self.biases: dict[str, LogitBias] = {}  # a request's logit_bias as tensors, built once
        # request id -> (its drafts, the drafter's q of each): what propose_for drew for its next step
        self.draft_probs: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        self.table_rows: dict[str, tuple[list[int], int, np.ndarray]] = {}  # see _table_row
        # seconds per phase when `profile_steps` is on (ember bench --profile-steps): with a
        # device sync at each phase's end, or, with async scheduling, CPU time only (no sync:
        # it would undo the overlap) plus `wait`, the time the CPU waited for sampled ids
        self.profile_steps = False
        self.step_times: dict[str, float] = defaultdict(float)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            rows = decode_graph_rows(config)
            self.graphs = DecodeGraphs(self.model, rows, config.max_blocks_per_seq, self.device,
                                       state_slots=self.states is not None)
            self.graphs.capture()
            if isinstance(self.drafter, Eagle3Drafter):  # its draft steps are decode-shaped too (a row a request)
                self.drafter.capture_graphs(config.max_num_seqs, config.max_blocks_per_seq)
            elif isinstance(self.drafter, DraftModel):  # it also follows the verify steps, as the target does
                self.drafter.capture_graphs(rows, config.max_blocks_per_seq)
        self.piecewise: PiecewiseGraphs | None = None
        if use_graphs and self.states is not None:
            # a linear-attention layer's prefill follows the step's sequences on the host (its chunks)
            logger.info("no piecewise CUDA graphs for %s: its mixed and prefill steps run eager", mc.architecture)
        elif use_graphs and config.mixed_graph_max_tokens > 0 and config.tensor_parallel_size == 1:
            tokens = min(config.mixed_graph_max_tokens, config.max_num_batched_tokens)
            self.piecewise = PiecewiseGraphs(self.model, tokens, config.torch_dtype, self.device, self.graphs.pool)
            self.piecewise.capture()
        # the tier's host buffers, in the background from here (after every capture: a host allocation
        # during a stream capture would break it); the first copy waits for them
        self.kv_copies.start_host_tier()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            logger.info("memory (GiB): total %.2f x utilization %.2f = %.2f; weights %.2f, peak activations %.2f, "
                        "CUDA graphs %.2f (reserved %.2f), drafts' probabilities %.2f, KV cache %.2f (%s) = %d "
                        "blocks of %d tokens (%d tokens); free now %.2f", total / 2**30, config.gpu_memory_utilization,
                        config.gpu_memory_utilization * total / 2**30, self.weight_bytes / 2**30,
                        self.activation_bytes / 2**30, self.graph_pool_bytes / 2**30,
                        self.graph_reserve / 2**30, self.draft_probs_bytes / 2**30, self.kv_cache.nbytes / 2**30, _dtype_name(self.kv_cache.dtype),
                        self.num_blocks, config.block_size, self.num_blocks * config.block_size, free / 2**30)
        else:
            logger.info("memory: weights %.1f MiB (%s; %.2fx the file's %.1f MiB of tensors), KV cache %.1f MiB "
                        "(%s) = %d blocks of %d tokens (%d tokens)", self.weight_bytes / 2**20,
                        {"gguf": "GGUF blocks", "fp8": "fp8 linear layers", "awq": "AWQ weights as GGUF blocks",
                         "gptq": "GPTQ weights as GGUF blocks", "compressed-tensors": "int weights as GGUF blocks"
                         }.get(config.quantization, _dtype_name(config.torch_dtype)),
                        self.weight_bytes / max(1, self.file_tensor_bytes), self.file_tensor_bytes / 2**20,
                        self.kv_cache.nbytes / 2**20, _dtype_name(self.kv_cache.dtype),
                        self.num_blocks, config.block_size, self.num_blocks * config.block_size)

    def _host_tier_gib(self, block: int) -> float:
        """GiB of the host tier: kv_offload_gib, or unset, the default (defaults.host_tier_default) for
        this device, KV pool (the blocks of every cache that moves to host slots) and host."""
        config = self.config
        if config.kv_offload_gib is not None:
            return config.kv_offload_gib
        default = host_tier_default(self.device.type, self.num_blocks * block, host_memory_bytes(),
                                    engines_on_host(config.tensor_parallel_size),
                                    kv_offload_refusal(config.enable_prefix_caching, config.model_config))
        log = logger.info if self.device.type == "cuda" else logger.debug
        if default.gib:
            log("kv_offload_gib=%.2f (default %s): a host tier of %d blocks, its buffers made in the background "
                "after start-up", default.gib, default.why, int(default.gib * 2**30) // block)
        else:
            log("kv_offload_gib=0 (default %s)", default.why)
        return default.gib

    def _recurrent_states(self) -> RecurrentStates:
        """A slot of state for each of max_num_seqs requests (runner/recurrent_state.py); on the CPU a
        defaulted max_num_seqs is lowered so that the slots fit the memory a KV pool gets by default."""
        config, mc = self.config, self.config.model_config
        layers = self.model.linear_attention_layers()
        per_slot = RecurrentStates.bytes_per_slot(layers, config.torch_dtype)
        seats = config.max_num_seqs
        if self.device.type == "cpu" and "max_num_seqs" not in config.setting_sources:
            seats = max(1, min(seats, CPU_KV_CACHE_MEMORY // per_slot))
            if seats < config.max_num_seqs:
                logger.info("max_num_seqs %d, not the default %d: %d recurrent-state slots of %.1f MiB fit in %.0f "
                            "MiB", seats, config.max_num_seqs, seats, per_slot / 2**20, CPU_KV_CACHE_MEMORY / 2**20)
                self.config = dataclasses.replace(config, max_num_seqs=seats)
        states = RecurrentStates(layers, seats, config.torch_dtype, self.device)
        logger.info("recurrent state: %.1f MiB, one slot of %.2f MiB for each of max_num_seqs=%d requests (%d "
                    "linear-attention layers), apart from the KV pool, which holds the %d attention layers",
                    states.nbytes / 2**20, per_slot / 2**20, seats, len(layers), mc.num_attention_layers)
        return states

    def _keep_state_snapshots(self, memory: int) -> int:
        """Snapshot slots for the prefix cache's hits (scheduler/state_snapshots.py): num_state_snapshots,
        else as many as STATE_SNAPSHOT_SHARE of the cache memory holds, at most one a KV block (each
        is keyed by one). Returns their bytes."""
        config, states = self.config, self.states
        per_slot = RecurrentStates.bytes_per_slot(self.model.linear_attention_layers(), config.torch_dtype)
        count = config.num_state_snapshots
        if count is None:
            most = config.num_kv_blocks or config.max_num_seqs * config.max_blocks_per_seq
            count = min(int(memory * STATE_SNAPSHOT_SHARE) // per_slot, most)
        states.keep_snapshots(count)
        self.num_state_snapshots = count
        logger.info("recurrent-state snapshots for prefix-cache hits: %d of %.2f MiB (%.1f MiB, %.0f%% of the %.1f "
                    "MiB for caches)", count, per_slot / 2**20, states.snapshot_bytes / 2**20,
                    100 * states.snapshot_bytes / max(1, memory), memory / 2**20)
        return states.snapshot_bytes

    def _load_model(self, files) -> torch.nn.Module:
        config = self.config
        model = load_model(files, config.model_config, config.max_model_len, config.torch_dtype, config.device,
                           config.attention_backend, config.seed, config.quantization)
        if self.device.type == "cpu" and cpu_packing_supported(config.torch_dtype):
            for module in model.modules():
                if hasattr(module, "pack_for_cpu"):
                    module.pack_for_cpu()
        if config.deterministic:
            make_batch_invariant(model)
        return model

    def _image_embedder(self, files) -> ImageEmbedder | None:
        c = self.config
        if c.model_config.vision is None:
            return None
        vision = load_vision_model(files, c.model_config, c.torch_dtype, c.device, c.seed, c.mmproj)
        v = c.model_config.vision
        return ImageEmbedder(vision, self.model.model.embed, self.device,
                             (v.image_token_id, v.video_token_id) if v.video_token_id else (v.image_token_id,))

    def _attach_kv_cache(self) -> None:
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[-1, i]  # one tensor for MLA

    def sleep(self, level: int) -> None:
        """Free the KV pool (its contents are gone) and, at level 2, the weights (EngineCore.sleep)."""
        if self.drafter is not None:
            raise ValueError("sleep is not supported with a draft model (speculative_config): start without it")
        if self.graphs is not None or self.piecewise is not None:
            raise ValueError("sleep is not supported with CUDA graphs (they hold the KV pool's addresses): start "
                             "the server with --enforce-eager")
        self._asleep = (level, tuple(self.kv_cache.shape))
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        self.kv_cache = None
        if level == 2:
            self.model = self.images = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _return_freed_heap()

    def wake_up(self) -> None:
        level, shape = self._asleep
        if level == 2:
            files = locate_model(self.config.model, self.config.load_format)
            self.model = self._load_model(files)
            self.images = self._image_embedder(files)
        self.kv_cache = _zeros(shape, self.config.kv_cache_torch_dtype, self.device)
        self._attach_kv_cache()
        del self._asleep

    def kv_caches(self) -> list[torch.Tensor]:
        """The caches over the pool's block ids, whose blocks go to host memory together: the
        target's, then a drafter's."""
        return [self.kv_cache] + ([self.drafter.kv_cache] if self.drafter is not None else [])

    @property
    def num_kv_layers(self) -> int:
        return _num_kv_layers(self.config.model_config)

    def kv_bytes_per_block(self) -> int:
        """K and V of one block in every layer (MLA: the latent alone), in the cache dtype (fp8:
        half of bfloat16's); 0 for an encoder, whose blocks are bookkeeping only."""
        mc, c = self.config.model_config, self.config
        draft = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        return mc.kv_planes * _num_kv_layers(mc) * c.block_size * rank_kv_heads(mc) * mc.cache_head_dim \
            * c.kv_cache_torch_dtype.itemsize + draft

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes

    @property
    def num_kv_heads(self) -> int:
        return rank_kv_heads(self.config.model_config)

    def _cache_memory(self) -> int:
        """Bytes for the KV pool (and the recurrent-state snapshots, where there are any)."""
        c = self.config
        if c.kv_cache_memory is not None:
            return c.kv_cache_memory
        if self.device.type == "cuda":
            # the pool gets utilization x total minus what is already used (weights, other
            # processes, the CUDA context) minus the profiled peak of one full-budget forward
            # an earlier engine of this process that is gone but not yet collected (a cycle)
            # still holds its weights and cache, and torch's allocator keeps freed memory:
            # both count as used below unless released first (as vLLM does before profiling)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            return int(c.gpu_memory_utilization * total - (total - free) - self.activation_bytes - self.graph_reserve
                       - self.tower_graph_reserve - self.draft_probs_bytes)
        return CPU_KV_CACHE_MEMORY

    def _num_kv_blocks(self, memory: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        # never more than every sequence slot at full length could use; the memory holds the null block too
        most = c.max_num_seqs * c.max_blocks_per_seq
        per_block = self.kv_bytes_per_block()
        if not per_block:
            return most
        blocks = min_over_ranks(min(memory // per_block - self.num_null_blocks, most))
        if blocks <= 0:
            raise ValueError(f"no memory left for the KV cache ({memory} bytes): raise kv_cache_memory "
                             "or gpu_memory_utilization")
        return blocks

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak memory of one forward over `max_num_batched_tokens` tokens (as sequences of
        at most max_model_len) plus sampling `max_num_seqs` rows, measured before the KV
        pool exists; a vision-language model's as a step over images, its tower run first over
        the encoder budget's worth (ImageEmbedder.profile_inputs). It also compiles the
        prefill-path Triton kernels."""
        c, mc = self.config, self.config.model_config
        tokens = c.max_num_batched_tokens
        seq = min(tokens, c.max_model_len)
        lens = [seq] * (tokens // seq) + ([tokens % seq] if tokens % seq else [])
        per_seq = -(-seq // c.block_size)
        cache = torch.zeros(mc.kv_planes, per_seq * len(lens), c.block_size, self.num_kv_heads, mc.cache_head_dim,
                            dtype=c.kv_cache_torch_dtype, device=self.device)
        for attn in self.model.attention_layers():
            attn.k_cache, attn.v_cache = cache[0], cache[-1]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        dev = self.device
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        # sequence i owns blocks [i * per_seq, (i + 1) * per_seq): slot = i * per_seq * block_size + position
        slots = torch.cat([i * per_seq * c.block_size + torch.arange(n, device=dev) for i, n in enumerate(lens)])
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.arange(per_seq * len(lens), dtype=torch.int32, device=dev).view(len(lens), per_seq),
            query_lens_cpu=lens, seq_lens_cpu=lens, eager=True)  # the peak of an eager step's forward
        if self.states is not None:
            meta.state_slots_cpu = [i % self.states.num_slots for i in range(len(lens))]
            meta.state_slots = torch.tensor(meta.state_slots_cpu, dtype=torch.int64, device=dev)
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        images = None
        if self.images is not None:  # the tower at its budget first, its embeddings then in the forward's rows
            images = self.images.profile_inputs(ids, c.max_num_encoder_input_tokens or tokens)
        if self.mrope is not None:  # image rows turn by (t, h, w): the [3, T] path
            positions = positions.expand(3, -1)
        hidden = self._split_aux(self.model(ids, positions, meta, *((images.embeds, images.deepstack)
                                                                    if images is not None else ())))[0]
        logits = hidden
        if c.runner == "generate":
            logits = self.model.compute_logits(hidden[: min(tokens, c.max_num_seqs)]).float()
            logits.softmax(-1).cumsum(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden, cache, logits, images
        torch.cuda.empty_cache()
        return peak

    @property
    def graph_pool_bytes(self) -> int:
        return sum(g.pool_bytes for g in (self.graphs, self.piecewise) if g is not None)

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput,
               fill_grammar_masks: Callable[[], dict[str, torch.Tensor]] | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling; read the requests' counters as the plan
        left them (before `Scheduler.mark_launched`). `fill_grammar_masks()` gives request id ->
        its allowed-token bits (structured output), applied to its row's logits before
        sampling; all n samples of a forking request share it. It is called once the forward
        and the LM head are queued, so on CUDA the CPU fills the masks while the GPU computes.
        Logprobs and prompt logprobs are computed here and read back by `collect`."""
        copies = self.kv_copies.launch(plan, self.kv_caches())  # host memory's, on CUDA on a copy stream
        if plan.block_copies:  # forked samples and partial-block hits get their own copy of the block
            copy_blocks(self.kv_caches(), plan.block_copies)
        if self.states is not None:
            for req in plan.preempted:  # recomputed from its first token, into a fresh slot
                self.states.release(req.request_id)
        if self.images is not None:
            for req in plan.preempted:
                self.images.release(req.request_id)
        if plan.is_empty:  # copies alone: its running requests wait for the blocks its swap-outs give back
            return LaunchedStep(plan, copies=copies)
        clock = self._clock()
        input_ids, positions, meta, sample_rows, sampled_chunks = self._prepare(plan)
        images = None
        if self.images is not None:  # a vision-language model: image embeddings where chunks cover images
            images = self.images.inputs(plan, input_ids)
        clock("prepare")
        self.kv_copies.before_forward()
        hidden = None
        if images is not None:  # eager: the graphs embed token ids at 1-D positions
            meta.eager = True
            hidden = self.model(input_ids, positions, meta, images.embeds, images.deepstack)
        elif positions.dim() == 2:
            meta.eager = True
            hidden = self.model(input_ids, positions, meta)
        elif self.graphs is not None:  # a decode step, or one verifying drafts (a token a decode row)
            hidden = self.graphs.replay_step(input_ids, positions, meta, plan.verifies_drafts)
        if hidden is None:
            if self.piecewise is not None and len(input_ids) <= self.piecewise.max_tokens:
                hidden = self.piecewise.run(input_ids, positions, meta)
            elif self.encoder:
                hidden = self.model(input_ids, positions, meta, self._token_type_ids(plan))
            else:
                meta.eager = True
                hidden = self.model(input_ids, positions, meta)
        hidden, aux = self._split_aux(hidden)
        if plan.state_saves:  # states where chunks ended on a block boundary, for the prefix cache
            self.states.save(plan.state_saves)
        if self.drafter is not None:  # speculative decoding's drafter: its KV for the step's tokens
            self.drafter.follow(plan, input_ids, positions, meta, aux)
        clock("forward")
        step = LaunchedStep(plan, copies=copies)
        if self.pooler is not None:  # no sampling: the prompts that end here give their vectors
            pooled = self.pooler.pool(hidden, plan)
            if pooled:
                vectors = torch.stack(list(pooled.values()))
                if self.config.model_config.classifier is not None:  # the pooled token's state -> label logits
                    vectors = self.model.classify(vectors.to(hidden.dtype)).float()
                step.pooled = list(pooled), to_host(vectors, self.pin)
            sampled_chunks = []
        if sampled_chunks:
            # a request that forks into n samples draws n tokens from its one row of logits; a
            # chunk with K drafts samples each of its K + 1 rows, row j after drafts[:j]
            # (row j verifies drafts[j] with the drafter's q where it drew from one)
            owners, hidden_rows, drafted, verifies = step.owners, [], [], []
            for c, last in zip(sampled_chunks, sample_rows):
                req, k = c.request, len(c.draft_token_ids)
                step.rows[req.request_id] = len(owners)
                if k:
                    owners += [(req, 0)] * (k + 1)
                    hidden_rows += range(last - k, last + 1)
                    drafted += [c.draft_token_ids[:j] for j in range(k + 1)]
                    q = self._verified_probs(req, c.draft_token_ids)
                    verifies += ([None] * k if q is None else list(zip(c.draft_token_ids, q))) + [None]
                else:
                    owners += [(req, i) for i in range(req.num_samples_to_draw)]
                    hidden_rows += [last] * req.num_samples_to_draw
                    drafted += [()] * req.num_samples_to_draw
                    verifies += [None] * req.num_samples_to_draw
            if len(owners) == len(sample_rows) == hidden.shape[0]:  # every row samples once (decode): no gather
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(hidden[to_device(hidden_rows, self.device, torch.int64)])
            grammar_masks = fill_grammar_masks() if fill_grammar_masks is not None else {}
            rows = [self._sampling_row(req, i, _mask_at(grammar_masks.get(req.request_id), len(after)), step.failed,
                                       after, draft) for (req, i), after, draft in zip(owners, drafted, verifies)]
            result = self.sampler(logits, rows)
            step.tokens = result.tokens
            step.host_tokens = to_host(step.tokens, self.pin)
            if result.invalid is not None:
                step.host_invalid = to_host(result.invalid, self.pin)
            clock("sample")
            if result.logprobs is not None:  # keyed by the sample's own request id (a fork's child id)
                keys = [req.request_id if i == 0 else req.child_id(i) for req, i in
                        (owners[row] for row in result.logprob_rows)]
                step.logprobs = keys, result.logprobs.to_host(self.pin)
        for chunk, rows in self._prompt_logprob_rows(plan):
            req = chunk.request
            targets = to_device(req.prompt_token_ids[rows.start - rows.offset + 1: rows.stop - rows.offset + 1],
                                self.device, torch.int64)
            logits = self.model.compute_logits(hidden[rows.start:rows.stop])
            pending = token_logprobs(logits, targets, [req.sampling_params.prompt_logprobs] * len(targets))
            step.prompt_logprobs[req.request_id] = req.num_computed_tokens + 1, pending.to_host(self.pin)
        if self.pin and (step.host_tokens is not None or step.prompt_logprobs or step.pooled is not None):
            step.ready = torch.cuda.Event()  # the copies above are complete once the device passes it
            step.ready.record()
        self.last_launched = step
        if self.profile_steps:
            self.step_times["steps"] += 1
        return step

    def _split_aux(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's hidden states and, for an EAGLE-3 head, the target layers' it returns after them."""
        if not isinstance(self.drafter, Eagle3Drafter):
            return hidden, None
        size = self.config.model_config.hidden_size
        return hidden[:, :size].contiguous(), hidden[:, size:].contiguous()

    @property
    def draft_probs_bytes(self) -> int:
        """The most the drafts' q rows (float32, a vocabulary each: `draft_probs`) hold between
        proposing and verifying, kept out of the KV pool: K rows for each request speculation
        runs for (disable_by_batch_size bounds them)."""
        spec = self.config.speculative_config
        if self.drafter is None:
            return 0
        seqs = min(self.config.max_num_seqs, spec.disable_by_batch_size or self.config.max_num_seqs)
        return spec.num_speculative_tokens * seqs * self.config.model_config.vocab_size * 4

    def propose_for(self, requests: list[Request], sample: bool = True) -> list[list[int]]:
        """The drafter's drafts for each request's next step (speculative decoding's draft_model
        and eagle3 methods): up to K, as far as max_tokens, max_model_len and the blocks the
        request holds go (the drafter writes its KV there). A request that samples draws each
        draft from the drafter's distribution q under its own sampling parameters (its seed's
        generator included) and keeps q for the step that verifies them (`draft_probs`); a
        greedy one drafts the argmax. sample=False: every request drafts the raw argmax, kept
        or not as a point mass (a drafter without probabilities; for comparisons). Where every
        draft is a raw argmax (sample=False, or only greedy requests whose logits the sampler
        leaves as they are), the drafts stay on the device until the last position."""
        k, c = self.config.speculative_config.num_speculative_tokens, self.config
        limits = []
        for r in requests:
            room = len(r.block_ids) * c.block_size - r.num_computed_tokens + self.drafter.drafts_without_kv
            limit = min(k, room, c.max_model_len - r.num_tokens - 1)
            if r.max_tokens is not None:
                limit = min(limit, r.max_tokens - len(r.output_token_ids) - 1)
            limits.append(max(limit, 0))
        tables = [self._table_row(r) for r in requests]
        if not sample or all(_raw_argmax(r, limit) for r, limit in zip(requests, limits) if limit > 0):
            for req in requests:
                self.draft_probs.pop(req.request_id, None)
            return self.drafter.propose(requests, limits, tables, None)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor | None]] = [[] for _ in requests]

        def draw(logits: torch.Tensor, active: list[int]) -> list[int]:
            rows = [self._sampling_row(requests[i], 0, None, {}, drafts[i]) if sample else _ARGMAX for i in active]
            tokens, q = self.sampler.draft(logits, rows)
            tokens = tokens.tolist()
            for i, token, q_row in zip(active, tokens, q):
                drafts[i].append(token)
                probs[i].append(q_row)
            return tokens

        self.drafter.propose(requests, limits, tables, draw)
        for req, drafted, q in zip(requests, drafts, probs):
            self.draft_probs.pop(req.request_id, None)
            if drafted and q[0] is not None:
                self.draft_probs[req.request_id] = drafted, q
        return drafts

    def _verified_probs(self, req: Request, drafts: list[int]) -> list[torch.Tensor] | None:
        """q of each draft a verifying chunk holds (a prefix of those last proposed: a grammar or
        the step's budget may cut them), or None: the drafts are point masses (prompt lookup,
        greedy requests)."""
        entry = self.draft_probs.get(req.request_id)
        if entry is None or entry[0][:len(drafts)] != drafts:
            return None
        return entry[1][:len(drafts)]

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled ids (and logprobs); request id -> its tokens
        (n when it forks)."""
        out = ModelRunnerOutput()
        start = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        if self.profile_steps:
            self.step_times["wait"] += time.perf_counter() - start
        if step.logprobs is not None:
            keys, pending = step.logprobs
            for key, logprobs in zip(keys, pending.unpack()):
                out.logprobs.setdefault(key, []).append(logprobs)
        for request_id, (first, pending) in step.prompt_logprobs.items():
            out.prompt_logprobs[request_id] = PromptLogprobs(first, pending.unpack())
        if step.host_tokens is not None:
            for (req, _), token in zip(step.owners, step.host_tokens.tolist()):
                out.sampled.setdefault(req.request_id, []).append(token)
        if step.pooled is not None:
            out.pooled = dict(zip(step.pooled[0], step.pooled[1].tolist()))
        out.failed = dict(step.failed)
        out.kv_load_seconds = self.kv_copies.collect(step.copies)
        if step.host_invalid is not None:
            for (req, _), invalid in zip(step.owners, step.host_invalid.tolist()):
                if invalid:
                    out.failed.setdefault(req.request_id, "the model's scores left no token that the output "
                                                          "constraint allows (NaN, or every allowed token masked)")
        return out

    def _clock(self):
        """clock(phase) adds the seconds since the last call to step_times[phase] when
        profiling (after a device sync, unless async scheduling overlaps the steps); a
        no-op otherwise."""
        if not self.profile_steps:
            return lambda phase: None
        synced = self.device.type == "cuda" and not self.config.async_scheduling
        sync = torch.cuda.synchronize if synced else (lambda: None)
        last = [time.perf_counter()]

        def clock(phase: str) -> None:
            sync()
            now = time.perf_counter()
            self.step_times[phase] += now - last[0]
            last[0] = now

        return clock

    def _sampling_row(self, req: Request, sample_index: int, allowed: torch.Tensor | None,
                      failed: dict[str, str], drafted: list[int] | tuple = (),
                      draft: tuple[int, torch.Tensor] | None = None) -> SamplingRow:
        """Turn one request's parameters into its row (its generator, its logit_bias
        tensors); a row at a drafted position sees the drafts before it as output (penalties,
        min_tokens, bad words), and `draft` is the (draft, q) it verifies by speculative sampling.
        If that fails, the request alone fails (`failed`): it gets a greedy stand-in row, and its
        token is dropped when the step is collected."""
        try:
            output = req.output_token_ids + list(drafted) if drafted else req.output_token_ids
            return SamplingRow(req.sampling_params, self._generator(req, sample_index), req.prompt_token_ids,
                               output, req.eos_token_ids, allowed, self._bias(req), draft)
        except Exception as e:
            logger.exception("request %s: its sampling parameters could not be applied", req.request_id)
            failed[req.request_id] = f"its sampling parameters could not be applied ({type(e).__name__})"
            return SamplingRow(_GREEDY, None, [], [], frozenset())

    def _generator(self, req: Request, sample_index: int) -> torch.Generator | None:
        """A seeded request's own generator; sample i of a forking request is seeded seed + i
        (mod 2**64: any seed SamplingParams takes is a valid generator seed)."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        key = req.request_id if sample_index == 0 else req.child_id(sample_index)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=self.device).manual_seed((seed + sample_index) % (1 << 64))
        return self.generators[key]

    def _bias(self, req: Request) -> LogitBias | None:
        bias = req.sampling_params.logit_bias
        if not bias:
            return None
        if req.request_id not in self.biases:
            self.biases[req.request_id] = LogitBias.of(bias, self.device)
        return self.biases[req.request_id]

    def release(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.release(request_id)
        self.generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        self.biases.pop(request_id, None)
        self.table_rows.pop(request_id, None)
        if self.states is not None:
            self.states.release(request_id)
        if self.images is not None:
            self.images.release(request_id)
        if self.mrope is not None:
            self.mrope.release(request_id)
        if self.pooler is not None:
            self.pooler.release(request_id)

    def _table_row(self, req: Request) -> np.ndarray:
        """The request's block-table row, [max_blocks_per_seq] int32 zero-padded, kept across
        steps: a request's block list only grows in place (only new entries are copied);
        a new list object (preemption, fork, blocks a sliding window gave back) rebuilds the row."""
        blocks = req.block_ids
        entry = self.table_rows.get(req.request_id)
        if entry is None or entry[0] is not blocks or entry[1] > len(blocks):
            entry = (blocks, 0, np.zeros(self.config.max_blocks_per_seq, dtype=np.int32))
        _, filled, row = entry
        if filled < len(blocks):
            row[filled:len(blocks)] = blocks[filled:]
            entry = (blocks, len(blocks), row)
        self.table_rows[req.request_id] = entry
        return row

    def _token_type_ids(self, plan: SchedulerOutput) -> torch.Tensor | None:
        """An encoder step's segment ids (a request's own, else 0), None when no request has any."""
        if not any(c.request.token_type_ids for c in plan.chunks):
            return None
        types = [t for c in plan.chunks for t in (c.request.token_type_ids or [0] * c.num_new_tokens)]
        return to_device(types, self.device, torch.int64)

    def _prompt_logprob_rows(self, plan: SchedulerOutput):
        """(chunk, rows) for chunks whose tokens predict prompt tokens that want logprobs.

        A chunk covers positions [s, e) in flattened rows [r, r + e - s); the row at position
        j predicts prompt token j + 1, so positions s .. min(e, P - 1) - 1 give logprobs."""
        row = 0
        for chunk in plan.chunks:
            req, n = chunk.request, chunk.num_new_tokens
            s = req.num_computed_tokens
            stop = min(s + n, req.num_prompt_tokens - 1)
            if req.sampling_params.prompt_logprobs is not None and stop > s:
                yield chunk, _Rows(row, row + stop - s, offset=row - s)
            row += n

    def _prepare(self, plan: SchedulerOutput):
        """Flatten the step's chunks into one varlen batch (see layers/attention/base.py).
        The int64 inputs travel to the device in one copy, the block tables in another.
        A pending input id (the request's last token, which the previous launched step
        samples) is gathered on the device from that step's sampled ids:

            ids        a  b  ?  c  ?       ? = 0 here, then ids[dst] = last.tokens[src]
            dst              2     4
            src              last.rows[req of row 2], last.rows[req of row 4]
        """
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled_chunks = []
        dst: list[int] = []
        src: list[int] = []
        mrope = self.mrope
        positions_3d: list[tuple[int, np.ndarray]] = []  # (first row, [3, n]) of chunks over images
        for chunk in plan.chunks:
            req, start = chunk.request, chunk.request.num_computed_tokens
            end = start + chunk.num_new_tokens
            prompt = req.num_prompt_tokens
            blocks = req.block_ids
            # decode: the hot path, no lists copied (M-RoPE: past the prompt, where rows turn by p + delta)
            if chunk.num_new_tokens == 1 and (mrope is None or start >= prompt):
                if req.num_pending_tokens:  # then `start` is the pending token's position
                    dst.append(len(ids))
                    src.append(self.last_launched.rows[req.request_id])
                    ids.append(0)
                else:
                    ids.append(req.output_token_ids[start - prompt] if start >= prompt else req.prompt_token_ids[start])
                positions.append(start if mrope is None else start + mrope.delta(req))
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                assert not req.num_pending_tokens, "a pending token is its request's only new token"
                drafts = chunk.draft_token_ids  # speculative decoding: verified after the last known token
                ids += req.token_slice(start, end - len(drafts)) + drafts if drafts else req.token_slice(start, end)
                if mrope is None:
                    positions += range(start, end)
                else:  # M-RoPE: the request's own positions; (t, h, w) apart where the chunk covers an image
                    flat, apart = mrope.chunk(req, start, end)
                    if apart is not None:
                        positions_3d.append((len(positions), apart))
                    positions += flat
                slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(len(ids))
            seq_lens.append(end)
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
                sampled_chunks.append(chunk)
        n, t = len(plan.chunks), len(ids)
        width = max(len(c.request.block_ids) for c in plan.chunks)
        tables = np.stack([self._table_row(c.request)[:width] for c in plan.chunks])
        dev = self.device
        state_slots: list[int] = []
        if self.states is not None:  # each sequence's recurrent-state slot, a new one zeroed or restored first
            restores = dict(plan.state_restores)
            state_slots = [self.states.slot(c.request.request_id, c.request.num_computed_tokens,
                                            restores.get(c.request.request_id)) for c in plan.chunks]
            self.states.start_slots()
        key_ends = (image_key_ends(plan, positions) if self.bidirectional_images else None) or []
        if positions_3d:  # M-RoPE's [3, t]: each row's (t, h, w), equal but in the image rows
            rows = np.tile(np.asarray(positions, dtype=np.int64), (3, 1))
            for first, apart in positions_3d:
                rows[:, first:first + apart.shape[1]] = apart
            positions = rows.ravel().tolist()
        # one int64 vector: ids [t] | positions [t, or 3 x t] | slots [t] | seq_lens [n] | query_start [n + 1]
        # | dst | src | state slots | key ends
        flat = to_device(ids + positions + slots + seq_lens + query_start + dst + src + state_slots + key_ends, dev,
                         torch.int64)
        input_ids, pos, slot_mapping, lens, starts, dst_idx, src_idx, state_idx, ends = flat.split(
            [t, len(positions), t, n, n + 1, len(dst), len(src), len(state_slots), len(key_ends)])
        if positions_3d:
            pos = pos.view(3, t)
        if dst:
            input_ids[dst_idx] = self.last_launched.tokens[src_idx]
        block_tables = torch.from_numpy(tables)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=starts.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            block_tables=to_device(block_tables, dev),
            query_lens_cpu=[c.num_new_tokens for c in plan.chunks],
            seq_lens_cpu=seq_lens,
        )
        if self.states is not None:
            meta.state_slots, meta.state_slots_cpu = state_idx, state_slots
        if key_ends:
            meta.key_ends = ends.to(torch.int32)
        return input_ids, pos, meta, sample_rows, sampled_chunks
