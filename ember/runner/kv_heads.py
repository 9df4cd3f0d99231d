"""How many KV heads a rank's cache holds: the target's pool and a drafter's own cache alike."""

from __future__ import annotations

from ember.distributed.parallel_state import tp_rank, tp_size
from ember.distributed.sharding import shard_heads
from ember.models.config import ModelConfig


def rank_kv_heads(mc: ModelConfig) -> int:
    """The KV heads this rank's cache holds (all of them without tensor parallelism; MLA's one latent)."""
    if mc.mla:
        return mc.cache_kv_heads
    return shard_heads(mc.num_heads, mc.num_kv_heads, tp_rank(), tp_size()).num_kv_heads
