"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into one
forward pass and the sampled tokens."""

from __future__ import annotations

import logging

import torch

from ember.config import CPU_KV_CACHE_MEMORY, EngineConfig
from ember.layers.attention import AttentionMetadata
from ember.loader.model_files import load_model, locate_model
from ember.runner.sampler import Sampler
from ember.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        mc = config.model_config
        files = locate_model(config.model, config.load_format)
        self.model = load_model(files, mc, config.max_model_len, config.torch_dtype, config.device,
                                config.attention_backend, config.seed)
        self.num_blocks = self._num_kv_blocks()
        shape = (2, mc.num_layers, self.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        # zeroed: padded block-table entries are read (then masked), never NaN
        self.kv_cache = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.sampler = Sampler(config.seed)
        self.generators: dict[str, torch.Generator] = {}
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)", self.num_blocks,
                    config.block_size, self.num_blocks * config.block_size, self.kv_cache.nbytes / 2**20)

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
            free, total = torch.cuda.mem_get_info(self.device)
            memory = int(free - (1 - c.gpu_memory_utilization) * total)
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
    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        input_ids, positions, meta, sample_rows, sampled_chunks = self._prepare(plan)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[sample_rows])
        reqs = [c.request for c in sampled_chunks]
        tokens = self.sampler(logits, [r.sampling_params for r in reqs], [self._generator(r) for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, tokens)}

    def _generator(self, req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        if req.request_id not in self.generators:
            self.generators[req.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[req.request_id]

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

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
