"""Decode-attention kernel configs on the GPU: achieved KV bandwidth per (BLOCK_N,
num_warps, num_stages, splits) at the benchmark shapes, with a bfloat16 or an fp8 cache.
`python3 benchmarks/scripts/decode_sweep.py [fp8] [--page 128] [--only qwen3-0.6b bs256] [--splits 1,2]`
(--splits: the split counts tried besides the engine's own choice)."""

import argparse
import itertools

import torch
from triton.testing import do_bench

from ember.kernels.decode_attention import decode_attention, num_decode_splits

SHAPES = {"qwen3-0.6b bs256 ctx U[100,2048]": (256, 16, 8, 100, 2048),
          "llama-8b bs512 ctx U[1000,2000]": (512, 32, 8, 1000, 2000),
          "qwen3-0.6b bs1 ctx 640": (1, 16, 8, 640, 640)}


def case(batch, heads, kv_heads, lo, hi, page=16, dim=128, seed=0, kv_dtype=torch.bfloat16):
    """q, the caches (in kv_dtype), block tables, seq lens and the bytes of KV one step reads."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    per = (lens + page - 1) // page
    num_blocks = int(per.sum()) + 8
    order = torch.randperm(num_blocks, generator=g)
    width = int(per.max())
    tables = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per.tolist()):
        tables[i, :n] = order[at:at + n]
        at += n
    kc = torch.randn(num_blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    vc = torch.randn(num_blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    nbytes = int(lens.sum()) * kv_heads * dim * 2 * kc.element_size()
    return q, kc, vc, tables.cuda(), lens.to(torch.int32).cuda(), nbytes


def sweep(kv_dtype: torch.dtype, page: int, only: str, extra_splits: list[int]) -> None:
    best = None
    for name, (batch, heads, kv_heads, lo, hi) in SHAPES.items():
        if only and not name.startswith(only):
            continue
        q, kc, vc, tables, lens, nbytes = case(batch, heads, kv_heads, lo, hi, page=page, kv_dtype=kv_dtype)
        own = num_decode_splits(batch, kv_heads)
        ref = decode_attention(q, kc, vc, tables, lens, 0.088, own, block_n=64, num_warps=4, num_stages=3).float()
        rows = []
        for bn, nw, ns, sp in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4, 5),
                                                sorted({own, *extra_splits})):
            if page % bn and bn % page:
                continue
            try:
                out = decode_attention(q, kc, vc, tables, lens, 0.088, sp, block_n=bn, num_warps=nw, num_stages=ns)
                assert (out.float() - ref).abs().max() < 2e-2
                ms = do_bench(lambda: decode_attention(q, kc, vc, tables, lens, 0.088, sp, block_n=bn,
                                                       num_warps=nw, num_stages=ns), warmup=5, rep=20)
                rows.append((ms, bn, nw, ns, sp))
            except Exception as e:  # out of shared memory etc.
                print(f"  {bn},{nw},{ns},{sp}: {type(e).__name__}")
        rows.sort()
        if best is None:
            best = rows[0][1:4]
        print(f"{name}, {kv_dtype}, page {page}: engine splits {own}, {nbytes / 1e9:.2f} GB of KV")
        for ms, bn, nw, ns, sp in rows[:8] + [r for r in rows if r[1:] == (128, 4, 4, own)]:
            print(f"  BLOCK_N {bn:3d} warps {nw} stages {ns} splits {sp:2d}: {ms * 1e3:8.1f} us  "
                  f"{nbytes / ms / 1e6:7.0f} GB/s")
    print("BEST_QWEN=%d,%d,%d" % best)  # the first shape swept (by default Qwen3-0.6B at batch 256)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", nargs="?", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--only", default="")
    ap.add_argument("--splits", default="")
    ns = ap.parse_args()
    sweep(torch.float8_e4m3fn if ns.dtype == "fp8" else torch.bfloat16, ns.page, ns.only,
          [int(x) for x in ns.splits.split(",") if x])
