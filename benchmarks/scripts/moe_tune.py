"""Tile configs for the fused MoE kernels (ember/kernels/moe.py), chosen by timing on the
device: for each shape and token count, every candidate BLOCK_M (shared by the gate|up and
down passes, since both read one sorted layout), and for each pass the fastest of the
BLOCK_N x BLOCK_K x stages candidates. Writes ember/kernels/moe_configs.json under the GPU's
name, which kernels/moe.py reads on that GPU; prints each choice with its time against the
built-in heuristic's.

    python3 benchmarks/scripts/moe_tune.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 64 512 16384]
"""

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from ember.kernels import moe
from ember.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def shape(name: str) -> tuple[int, int, int, int]:
    cfg = ModelConfig.from_hf_config(json.loads((ROOT / "benchmarks" / "configs" / name / "config.json").read_text()))
    return cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok


def time_pass(a, w, out, layout, weights, rows_per_a, gated, cfg) -> float:
    return do_bench(lambda: moe.moe_gemm(a, w, out, *layout, weights, rows_per_a, gated, cfg), warmup=5, rep=20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 512, 16384])
    ns = ap.parse_args()
    device = torch.cuda.get_device_name()
    path = Path(moe.__file__).with_name("moe_configs.json")
    table = json.loads(path.read_text()) if path.exists() else {}
    start = time.time()
    for name in ns.shapes:
        experts, hidden, inter, top_k = shape(name)
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        for tokens in ns.tokens:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = moe.route_topk(torch.randn(tokens, experts, device="cuda"), top_k, True)
            act = torch.empty(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
            per_expert = tokens * top_k / experts
            block_ms = [16] if per_expert <= 1 else [16, 32] if per_expert <= 32 else [32, 64, 128] \
                if per_expert <= 256 else [64, 128]
            best = None
            for bm in block_ms:
                layout = moe.align_experts(ids, experts, bm)
                choice = {}
                total = 0.0
                for gated, a, w, n_out, wts, rpa in ((True, x, w13, act, None, top_k),
                                                     (False, act, w2, out, weights.reshape(-1), 1)):
                    timed = []
                    for bn, bk, stages in itertools.product([32, 64, 128], [64, 128], [3, 4]):
                        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8 if bm >= 32 else 1,
                               "num_warps": 4 if bm * bn <= 64 * 64 else 8, "num_stages": stages}
                        try:
                            timed.append((time_pass(a, w, n_out, layout, wts, rpa, gated, cfg), cfg))
                        except triton.runtime.errors.OutOfResources:
                            continue
                    ms, cfg = min(timed, key=lambda t: t[0])
                    choice["up" if gated else "down"] = cfg
                    total += ms
                if best is None or total < best[0]:
                    best = (total, choice)
            key = moe.config_key(experts, hidden, inter, top_k)
            table.setdefault(device, {}).setdefault(key, {})[str(tokens)] = best[1]
            up = down = moe.heuristic_config(experts, moe.token_bucket(tokens), top_k)
            layout = moe.align_experts(ids, experts, up["BLOCK_M"])
            heuristic = time_pass(x, w13, act, layout, None, top_k, True, up) + \
                time_pass(act, w2, out, layout, weights.reshape(-1), 1, False, down)
            print(f"TUNED {name} T={tokens}: {best[0] * 1e3:.1f} us (heuristic {heuristic * 1e3:.1f} us) "
                  f"{json.dumps(best[1])}  [{time.time() - start:.0f} s]", flush=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
