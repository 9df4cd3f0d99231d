"""A sparse mixture-of-experts MLP in one layer: hidden states in, hidden states out.

The router (`gate`, hidden -> one logit per expert) is inside, and so are the top-k
selection and its weights: softmax over the logits in float32, the k largest, renormalized
to sum to 1 where `renormalize` (Mixtral, Qwen3-MoE with norm_topk_prob). The experts'
weights are stacked: `w13` [E, 2I, H] (gate | up of each expert) and `w2` [E, H, I] (down);
the loader fills them one checkpoint tensor (shard) at a time.

On CUDA (and for tests through Triton's interpreter) the routing and the experts run as
kernels/moe.py's fused kernels, which CUDA graphs capture. The torch path (the CPU) groups
the (token, expert) pairs by expert and runs one gate|up and one down matmul per expert
that received a token, then adds each output, times its routing weight, into its token's row.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.distributed.parallel_state import tp_size
from ember.layers.activation import silu_and_mul
from ember.layers.kernel_paths import cuda_paths
from ember.layers.linear import Linear


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        if tp_size() > 1:
            raise ValueError("tensor parallelism does not split mixtures of experts yet: run the model with "
                             "tensor_parallel_size 1")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be within 1..num_experts ({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.gate = Linear(hidden_size, num_experts)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # shards: w13's 2e is expert e's gate, 2e + 1 its up; w2's e is expert e's down
        self.w13.num_shards, self.w13.weight_loader = 2 * num_experts, self.load_w13
        self.w2.num_shards, self.w2.weight_loader = num_experts, self.load_w2

    def load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        expert, half = divmod(shard, 2)
        _copy(param.data[expert].narrow(0, half * self.intermediate_size, self.intermediate_size), loaded, shard)

    def load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        _copy(param.data[shard], loaded, shard)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] logits -> (weights [T, k] in float32, expert ids [T, k])."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if cuda_paths(x):
            from ember.kernels.moe import fused_experts, route_topk

            weights, ids = route_topk(logits, self.top_k, self.renormalize)
            return fused_experts(x.contiguous(), self.w13, self.w2, weights, ids)
        weights, ids = self.route(logits)
        return grouped_experts(x, self.w13, self.w2, weights.to(x.dtype), ids)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * expert ids[t, k] (x[t]), one matmul pair per active expert."""
    top_k = ids.shape[1]
    if x.shape[0] == 1:  # one token (single-stream decode): its k experts directly, no sorting
        out = torch.zeros_like(x)
        for slot, expert in enumerate(ids[0].tolist()):
            out += weights[0, slot] * (silu_and_mul(x @ w13[expert].t()) @ w2[expert].t())
        return out
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x[tokens]
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            ys[rows] = silu_and_mul(xs[rows] @ w13[expert].t()) @ w2[expert].t()
            start += n
    out = torch.zeros_like(x)
    return out.index_add_(0, tokens, ys * weights.flatten()[order].unsqueeze(1))


def _copy(rows: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
    if rows.shape != loaded.shape:
        raise ValueError(f"shape mismatch for shard {shard}: parameter {tuple(rows.shape)}, "
                         f"checkpoint {tuple(loaded.shape)}")
    rows.copy_(loaded)
