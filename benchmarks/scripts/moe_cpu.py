"""The CPU path of the MoE layer (layers/moe.py grouped_experts: pairs grouped by expert, one
gate|up and one down matmul per active expert) against the plain loop over tokens and their
k experts, on a tiny MoE's shapes; ms per call, float32, all cores torch has.

    python3 benchmarks/scripts/moe_cpu.py [--experts 8 --top-k 2 --hidden 576 --inter 1536]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from ember.layers.moe import grouped_experts


def per_token_loop(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = x[t] @ w13[e].t()
            out[t] += weights[t, slot] * ((F.silu(h[:inter]) * h[inter:]) @ w2[e].t())
    return out


def timed(fn, *args, reps: int = 5) -> float:
    fn(*args)
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - start) / reps * 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    ns = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(ns.experts, 2 * ns.inter, ns.hidden, generator=g) * 0.02
    w2 = torch.randn(ns.experts, ns.hidden, ns.inter, generator=g) * 0.02
    print(f"E={ns.experts} k={ns.top_k} H={ns.hidden} I={ns.inter}, float32, {torch.get_num_threads()} threads")
    for tokens in ns.tokens:
        x = torch.randn(tokens, ns.hidden, generator=g)
        probs = torch.softmax(torch.randn(tokens, ns.experts, generator=g), dim=-1)
        weights, ids = torch.topk(probs, ns.top_k, dim=-1)
        want = per_token_loop(x, w13, w2, weights, ids)
        torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids), want, rtol=1e-4, atol=1e-5)
        loop = timed(per_token_loop, x, w13, w2, weights, ids, reps=1 if tokens > 256 else 5)
        grouped = timed(grouped_experts, x, w13, w2, weights, ids)
        print(f"T={tokens:5d}: per-token loop {loop:9.2f} ms, grouped {grouped:8.2f} ms, {loop / grouped:6.1f}x")


if __name__ == "__main__":
    main()
