"""How a layer's rows, heads and vocabulary divide among the tensor-parallel ranks (the
Megatron split): pure arithmetic, no process group.

    column-parallel   output rows [rank * n / tp, (rank + 1) * n / tp)
    row-parallel      input columns, the same way; the partial sums are all-reduced
    attention heads   q heads split evenly; KV heads too where num_kv_heads >= tp, else
                      each KV head is held by the tp / num_kv_heads ranks whose q heads use it
    vocabulary        ceil(vocab / tp) rows a rank; the last rank's rows past the vocabulary
                      are zero (padding)
"""

from __future__ import annotations

from dataclasses import dataclass


def _fitting_sizes(*counts: int) -> list[int]:
    return [t for t in range(1, max(counts) + 1) if all(c % t == 0 for c in counts)]


def split_evenly(size: int, rank: int, tp: int, what: str) -> tuple[int, int]:
    """(start, length) of `rank`'s part of `size` rows or columns."""
    if size % tp:
        raise ValueError(f"{what} ({size}) does not divide among {tp} tensor-parallel ranks: use a "
                         f"tensor_parallel_size among {_fitting_sizes(size)}")
    part = size // tp
    return rank * part, part


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: q heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads) of the checkpoint's."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, tp: int) -> HeadShard:
    """q heads evenly; KV heads evenly, or replicated where there are fewer than ranks.

    8 q / 2 KV heads on 4 ranks: rank 0 q 0-1 KV 0, rank 1 q 2-3 KV 0, rank 2 q 4-5 KV 1,
    rank 3 q 6-7 KV 1 (q head h attends with KV head h // (8 / 2))."""
    fits = num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)
    if not fits:
        sizes = [t for t in _fitting_sizes(num_heads) if num_kv_heads % t == 0 or t % num_kv_heads == 0]
        raise ValueError(f"{num_heads} attention heads ({num_kv_heads} KV heads) do not divide among {tp} "
                         f"tensor-parallel ranks: use a tensor_parallel_size among {sizes}")
    q = num_heads // tp
    if num_kv_heads >= tp:
        kv = num_kv_heads // tp
        return HeadShard(q, kv, rank * q, rank * kv)
    return HeadShard(q, 1, rank * q, rank * q // (num_heads // num_kv_heads))


def vocab_rows(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """(start, rows) of `rank`'s slice of the vocabulary, padding counted: every rank holds
    ceil(vocab / tp) rows."""
    rows = -(-vocab_size // tp)
    return rank * rows, rows
