"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into one
forward pass and the sampled tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ember.config import CPU_KV_CACHE_MEMORY, EngineConfig
from ember.layers.attention import AttentionMetadata
from ember.layers.linear import cpu_packing_supported
from ember.loader.model_files import load_model, locate_model
from ember.request import Request
from ember.runner.sampler import Sampler, SamplingRow, TokenLogprobs, token_logprobs
from ember.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobs:
    first_position: int  # the prompt position of tokens[0]
    tokens: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # n tokens when a request forks
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass
class _Rows:
    start: int
    stop: int
    offset: int  # row - position


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model_config
        files = locate_model(config.model, config.load_format)
        self.model = load_model(files, mc, config.max_model_len, config.torch_dtype, config.device,
                                config.attention_backend, config.seed)
        self.weight_bytes = sum(p.nbytes for p in self.model.parameters())
        if self.device.type == "cpu" and cpu_packing_supported(config.torch_dtype):
            for module in self.model.modules():
                if hasattr(module, "pack_for_cpu"):
                    module.pack_for_cpu()
        self.activation_bytes = self._profile_activations() if self.device.type == "cuda" else 0
        self.num_blocks = self._num_kv_blocks()
        shape = (2, mc.num_layers, self.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        # zeroed: padded block-table entries are read (then masked), never NaN
        self.kv_cache = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.sampler = Sampler(config.seed)
        self.generators: dict[str, torch.Generator] = {}
        logger.info("memory: weights %.1f MiB, peak activations %.1f MiB, KV cache %.1f MiB = %d blocks "
                    "of %d tokens (%d tokens)", self.weight_bytes / 2**20, self.activation_bytes / 2**20,
                    self.kv_cache.nbytes / 2**20, self.num_blocks, config.block_size,
                    self.num_blocks * config.block_size)

    def kv_bytes_per_block(self) -> int:
        mc, c = self.config.model_config, self.config
        return 2 * mc.num_layers * c.block_size * mc.num_kv_heads * mc.head_dim * c.torch_dtype.itemsize

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            memory = c.kv_cache_memory
        elif self.device.type == "cuda":
            # the pool gets utilization x total minus what is already used (weights, other
            # processes, the CUDA context) minus the profiled peak of one full-budget forward
            free, total = torch.cuda.mem_get_info(self.device)
            memory = int(c.gpu_memory_utilization * total - (total - free) - self.activation_bytes)
        else:
            memory = CPU_KV_CACHE_MEMORY
        # never more than every sequence slot at full length could use
        most = c.max_num_seqs * c.max_blocks_per_seq
        blocks = min(memory // self.kv_bytes_per_block(), most)
        if blocks <= 0:
            raise ValueError(f"no memory left for the KV cache ({memory} bytes): raise kv_cache_memory "
                             "or gpu_memory_utilization")
        return blocks

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak memory of one forward over `max_num_batched_tokens` tokens (plus sampling
        logits for `max_num_seqs` rows), measured before the KV pool exists."""
        c, mc = self.config, self.config.model_config
        tokens = c.max_num_batched_tokens
        blocks = -(-tokens // c.block_size)
        cache = torch.zeros(2, blocks, c.block_size, mc.num_kv_heads, mc.head_dim, dtype=c.torch_dtype,
                            device=self.device)
        for attn in self.model.attention_layers():
            attn.k_cache, attn.v_cache = cache[0], cache[1]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        positions = torch.arange(tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions, query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            query_lens_cpu=[tokens], seq_lens_cpu=[tokens])
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), positions, meta)
        self.model.compute_logits(hidden[: min(tokens, c.max_num_seqs)]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden, cache
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, grammar_masks: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        """`grammar_masks`: request id -> its allowed-token bits (structured output), applied
        to its row's logits before sampling; all n samples of a forking request share it."""
        grammar_masks = grammar_masks or {}
        for src, dst in plan.block_copies:  # forked samples get their own copy of a partial block
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        input_ids, positions, meta, sample_rows, sampled_chunks = self._prepare(plan)
        hidden = self.model(input_ids, positions, meta)
        out = ModelRunnerOutput()
        if sampled_chunks:
            # a request that forks into n samples draws n tokens from its one row of logits
            owners = [(c.request, i) for c in sampled_chunks for i in range(c.request.num_samples_to_draw)]
            rows_idx = torch.tensor([r for c, r in zip(sampled_chunks, sample_rows)
                                     for _ in range(c.request.num_samples_to_draw)], device=self.device)
            logits = self.model.compute_logits(hidden[rows_idx])
            rows = [self._sampling_row(req, i, grammar_masks.get(req.request_id)) for req, i in owners]
            result = self.sampler(logits, rows)
            for (req, i), token, lp in zip(owners, result.token_ids, result.logprobs):
                out.sampled.setdefault(req.request_id, []).append(token)
                if lp is not None:  # keyed by the sample's own request id (a fork's child id)
                    out.logprobs[req.request_id if i == 0 else req.child_id(i)] = lp
        for chunk, rows in self._prompt_logprob_rows(plan):
            req = chunk.request
            targets = torch.tensor(req.prompt_token_ids[rows.start - rows.offset + 1: rows.stop - rows.offset + 1],
                                   device=self.device)
            logits = self.model.compute_logits(hidden[rows.start:rows.stop])
            out.prompt_logprobs[req.request_id] = PromptLogprobs(
                first_position=req.num_computed_tokens + 1,
                tokens=token_logprobs(logits, targets, [req.sampling_params.prompt_logprobs] * len(targets)),
            )
        return out

    def _sampling_row(self, req: Request, sample_index: int, allowed: torch.Tensor | None) -> SamplingRow:
        return SamplingRow(req.sampling_params, self._generator(req, sample_index), req.prompt_token_ids,
                           req.output_token_ids, req.eos_token_ids, allowed)

    def _generator(self, req: Request, sample_index: int) -> torch.Generator | None:
        """A seeded request's own generator; sample i of a forking request is seeded seed + i."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        key = req.request_id if sample_index == 0 else req.child_id(sample_index)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=self.device).manual_seed(seed + sample_index)
        return self.generators[key]

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

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
        """Flatten the step's chunks into one varlen batch (see layers/attention/base.py)."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled_chunks = []
        for chunk in plan.chunks:
            req, start = chunk.request, chunk.request.num_computed_tokens
            end = start + chunk.num_new_tokens
            ids += req.all_token_ids[start:end]
            positions += range(start, end)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(len(ids))
            seq_lens.append(end)
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
                sampled_chunks.append(chunk)
        width = max(len(c.request.block_ids) for c in plan.chunks)
        tables = [c.request.block_ids + [0] * (width - len(c.request.block_ids)) for c in plan.chunks]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_lens_cpu=[c.num_new_tokens for c in plan.chunks],
            seq_lens_cpu=seq_lens,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
                meta, torch.tensor(sample_rows, dtype=torch.int64, device=dev), sampled_chunks)
