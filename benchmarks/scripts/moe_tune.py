"""Tile configs for the fused MoE kernels (ember/kernels/moe.py), chosen by timing on the
device: for each shape and token count, every candidate BLOCK_M (shared by the gate|up and
down passes, since both read one sorted layout), and for each pass the fastest of the
BLOCK_N x BLOCK_K x stages candidates; at small token counts the GEMV (each pair alone) too,
over its BLOCK_N x BLOCK_K x warps x stages. A shape whose config.json says MXFP4 (gpt-oss)
is tuned on random MXFP4 experts, with --fp8 every shape on random block-scaled FP8 experts
(DeepSeek-V3's and Qwen3-FP8's 128 x 128 scales), with --int 4 or 8 on random integer experts
(AWQ / GPTQ W4A16 or W8A16: groups of 128 columns with zero points), each under its own key
(",mxfp4", ",fp8", ",int4", ",int8"). Writes
ember/kernels/moe_configs.json under the GPU's name, which kernels/moe.py reads on that GPU;
prints each choice with its time against the built-in heuristic's.

    python3 benchmarks/scripts/moe_tune.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 64 512 16384]
        [--fp8 | --int 4|8] [--no-write]
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


GEMV_MAX_PAIRS_PER_EXPERT = 4.0  # token counts where the GEMV is a candidate


INT_GROUP = 128  # integer experts' columns a group: AWQ's and GPTQ's usual


def shape(name: str, fp8: bool, int_bits: int | None = None) -> tuple[int, int, int, int, str | None]:
    """(E, H, I, k, the experts' format: None, "mxfp4", "fp8", "int4" or "int8") of a config's MoE layers."""
    raw = json.loads((ROOT / "benchmarks" / "configs" / name / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    mxfp4 = (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    quant = "mxfp4" if mxfp4 else "fp8" if fp8 else f"int{int_bits}" if int_bits else None
    return cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, quant


def weights_of(experts: int, rows: int, cols: int, quant: str | None, halves: int):
    """Random experts [E, rows, cols]; `halves` 2 for gate|up (FP8 scale blocks a half)."""
    if quant is None:
        return torch.randn(experts, rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    if quant == "fp8":
        values = (64 * torch.randn(experts, rows, cols, device="cuda")).clamp(-448, 448).to(torch.float8_e4m3fn)
        blocks = (experts, halves * triton.cdiv(rows // halves, 128), triton.cdiv(cols, 128))
        return moe.FP8Experts(values, torch.rand(blocks, device="cuda") / (64 * cols ** 0.5))
    if quant in ("int4", "int8"):  # random int32 words (every value), float16 scales, uint8 zero points
        bits = int(quant[3:])
        groups = (experts, rows, triton.cdiv(cols, INT_GROUP))
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (experts, rows, cols * bits // 32), device="cuda",
                              dtype=torch.int32)
        zeros = torch.randint(0, 1 << bits, groups, device="cuda", dtype=torch.int32).to(torch.uint8)
        return moe.IntExperts(words, (torch.rand(groups, device="cuda") / (2 ** bits * cols ** 0.5)).half(), zeros,
                              bits, INT_GROUP, cols)
    blocks = torch.randint(0, 256, (experts, rows, cols // 2), device="cuda", dtype=torch.uint8)
    return moe.MXFP4Experts(blocks, torch.randint(118, 122, (experts, rows, cols // 32), device="cuda",
                                                  dtype=torch.uint8))


def time_pass(a, w, out, layout, ids, weights, rows_per_a, gated, cfg, swiglu) -> float:
    if cfg.get("GEMV"):
        return do_bench(lambda: moe.moe_gemv(a, w, out, ids, weights, rows_per_a, gated, cfg, swiglu=swiglu),
                        warmup=5, rep=20)
    return do_bench(lambda: moe.moe_gemm(a, w, out, *layout, weights, rows_per_a, gated, cfg, swiglu=swiglu),
                    warmup=5, rep=20)


def candidates(block_m: int | None):
    if block_m is None:  # the GEMV
        for bn, bk, warps, stages in itertools.product([8, 16, 32], [128, 256], [2, 4], [2, 3]):
            yield {"GEMV": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        return
    for bn, bk, stages in itertools.product([32, 64, 128], [64, 128], [3, 4]):
        yield {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8 if block_m >= 32 else 1,
               "num_warps": 4 if block_m * bn <= 64 * 64 else 8, "num_stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 512, 16384])
    ap.add_argument("--fp8", action="store_true", help="tune the shapes on block-scaled FP8 experts (key ',fp8')")
    ap.add_argument("--int", type=int, choices=(4, 8), dest="int_bits",
                    help="tune the shapes on integer experts of 4 or 8 bits in groups of 128 (key ',int4' / ',int8')")
    ap.add_argument("--no-write", action="store_true", help="print the choices, leave moe_configs.json as it is")
    ns = ap.parse_args()
    device = torch.cuda.get_device_name()
    path = Path(moe.__file__).with_name("moe_configs.json")
    table = json.loads(path.read_text()) if path.exists() else {}
    start = time.time()
    for name in ns.shapes:
        experts, hidden, inter, top_k, quant = shape(name, ns.fp8, ns.int_bits)
        swiglu = (1.702, 7.0) if quant == "mxfp4" else None
        w13, w2 = weights_of(experts, 2 * inter, hidden, quant, 2), weights_of(experts, hidden, inter, quant, 1)
        for tokens in ns.tokens:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = moe.route_topk(torch.randn(tokens, experts, device="cuda"), top_k, True)
            act = torch.empty(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
            per_expert = tokens * top_k / experts
            block_ms = [16] if per_expert <= 1 else [16, 32] if per_expert <= 32 else [32, 64, 128] \
                if per_expert <= 256 else [64, 128]
            if per_expert <= GEMV_MAX_PAIRS_PER_EXPERT:
                block_ms = [None, *block_ms]
            best = None
            for bm in block_ms:
                layout = moe.align_experts(ids, experts, bm) if bm else None
                choice = {}
                total = 0.0
                for gated, a, w, n_out, wts, rpa in ((True, x, w13, act, None, top_k),
                                                     (False, act, w2, out, weights.reshape(-1), 1)):
                    timed = []
                    for cfg in candidates(bm):
                        try:
                            timed.append((time_pass(a, w, n_out, layout, ids, wts, rpa, gated, cfg,
                                                    swiglu if gated else None), cfg))
                        except triton.runtime.errors.OutOfResources:
                            continue
                    ms, cfg = min(timed, key=lambda t: t[0])
                    choice["up" if gated else "down"] = cfg
                    total += ms
                if best is None or total < best[0]:
                    best = (total, choice)
            key = moe.config_key(experts, hidden, inter, top_k, quant)
            table.setdefault(device, {}).setdefault(key, {})[str(tokens)] = best[1]
            up = down = moe.heuristic_config(experts, moe.token_bucket(tokens), top_k, quant)
            layout = None if up.get("GEMV") else moe.align_experts(ids, experts, up["BLOCK_M"])
            heuristic = time_pass(x, w13, act, layout, ids, None, top_k, True, up, swiglu) + \
                time_pass(act, w2, out, layout, ids, weights.reshape(-1), 1, False, down, None)
            print(f"TUNED {name} T={tokens}: {best[0] * 1e3:.1f} us (heuristic {heuristic * 1e3:.1f} us) "
                  f"{json.dumps(best[1])}  [{time.time() - start:.0f} s]", flush=True)
    if not ns.no_write:
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")

if __name__ == "__main__":
    main()
