"""The floor a workload cannot beat on a GPU: bytes that must move over HBM and FLOPs that
must be done, each at the chip's peak, summed step by step over an idealized run.

The run: continuous batching with up to `max_num_seqs` sequences; a request's prompt is
prefilled once (FLOPs: 2 x matmul params per token + causal attention), then every decode
step reads all weights once and each running sequence's whole KV context, and does
2 x params FLOPs per sequence plus its attention. A step's floor is
max(bytes / bandwidth, FLOPs / peak); the run's floor is the sum.

A mixture of experts reads, per step and sparse layer, only the experts its tokens chose:
E x (1 - (1 - k/E)^B) of them for a batch of B under uniform routing (the dummy weights'
router is close to uniform), and its FLOPs count the k active experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ember.models.config import ModelConfig


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense


H200 = Chip("NVIDIA H200 (spec: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16)", 4.8e12, 989e12)


@dataclass(frozen=True)
class Floor:
    seconds: float
    bytes: float
    flops: float
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def describe(self, achieved_tok_s: float) -> str:
        return (f"floor {self.output_tokens_per_s:,.0f} output tok/s ({self.bytes / 1e12:.2f} TB to move, "
                f"{self.flops / 1e15:.2f} PFLOP, {self.seconds:.2f} s); achieved {achieved_tok_s:,.0f} = "
                f"{100 * achieved_tok_s / self.output_tokens_per_s:.0f} % of the floor")


def model_sizes(cfg: ModelConfig, dtype_bytes: int = 2) -> tuple[float, float, float, float]:
    """(bytes read per step apart from routed experts, active matmul params per token, KV
    bytes per token, attention FLOPs per query per context token)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn_params = h * (q + 2 * kv) + q * h
    sparse = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    dense_mlp = 3 * h * cfg.intermediate_size * (cfg.num_layers - sparse)
    shared = (3 * h * cfg.shared_expert_intermediate_size + h * cfg.num_experts) * sparse  # router, shared expert
    head = cfg.vocab_size * h
    resident = cfg.num_layers * attn_params + dense_mlp + shared + head
    active = resident + sparse * cfg.num_experts_per_tok * expert_params(cfg)
    kv_bytes = 2 * cfg.num_layers * kv * dtype_bytes
    attn_flops = 4 * cfg.num_layers * q  # q.k and p.v per head
    return resident * dtype_bytes, float(active), float(kv_bytes), float(attn_flops)


def expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


MXFP4_BYTES = 17 / 32  # a weight's 4 bits and its share of a 32-value group's 8-bit scale


def expert_bytes_read(cfg: ModelConfig, batch: int, dtype_bytes: int = 2) -> float:
    """Routed experts' bytes one step reads for `batch` tokens (module doc: uniform routing);
    MXFP4 experts (gpt-oss's, kept so on CUDA) at MXFP4_BYTES a weight."""
    sparse = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    if not sparse or not batch:
        return 0.0
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    return sparse * touched * expert_params(cfg) * (MXFP4_BYTES if cfg.mxfp4_experts else dtype_bytes)


def workload_floor(cfg: ModelConfig, lengths: Sequence[tuple[int, int]], max_num_seqs: int, chip: Chip = H200,
                   dtype_bytes: int = 2) -> Floor:
    """lengths: (prompt, output) tokens of each request, admitted in order."""
    weights, params, kv_tok, attn = model_sizes(cfg, dtype_bytes)
    total_s = total_bytes = total_flops = 0.0
    prompts = np.array([p for p, _ in lengths], dtype=np.float64)
    outs = np.array([o for _, o in lengths], dtype=np.int64)
    # prefill: compute bound at these sizes; the new KV is written once
    flops = 2 * params * prompts.sum() + attn * (prompts * (prompts + 1) / 2).sum()
    nbytes = kv_tok * prompts.sum()
    total_s += max(flops / chip.bf16_flops_per_s, nbytes / chip.hbm_bytes_per_s)
    total_bytes, total_flops = nbytes, flops
    waiting = list(range(len(lengths)))[::-1]
    ctx = np.zeros(0)
    left = np.zeros(0, dtype=np.int64)
    while waiting or len(ctx):
        while waiting and len(ctx) < max_num_seqs:
            i = waiting.pop()
            ctx, left = np.append(ctx, prompts[i]), np.append(left, outs[i])
        # one decode step: every running sequence makes one token (the first comes from prefill's last row)
        nbytes = weights + expert_bytes_read(cfg, len(ctx), dtype_bytes) + kv_tok * ctx.sum()
        flops = 2 * params * len(ctx) + attn * ctx.sum()
        total_s += max(nbytes / chip.hbm_bytes_per_s, flops / chip.bf16_flops_per_s)
        total_bytes += nbytes
        total_flops += flops
        ctx, left = ctx + 1, left - 1
        keep = left > 0
        ctx, left = ctx[keep], left[keep]
    return Floor(total_s, total_bytes, total_flops, int(outs.sum()))
