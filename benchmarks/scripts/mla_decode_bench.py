"""MLA decode on the GPU: the MLA kernel (kernels/mla_decode.py) against the generic decode
kernel as MLA ran before it (multi-query attention, the 576-dim head padded to 1024), at
DeepSeek-V2-Lite's shape by default: 16 heads over one latent of 512 + 64 dims, batch 256,
contexts U[1000, 2000], 128-token pages, bfloat16 (or fp8) cache; each kernel at the split
count the backend gives it, and with --sweep the MLA kernel at other tiles too (its config
is not yet swept). Prints each one's time, the KV bandwidth it reaches, and how far its output is from the
generic kernel's latent dims.

`python3 benchmarks/scripts/mla_decode_bench.py [fp8] [--sweep] [--heads 128] [--batch 256] [--lo 1000 --hi 2000]`
(--heads 128: DeepSeek-V3's)."""

import argparse
import itertools

import torch
from triton.testing import do_bench

from ember.kernels.decode_attention import decode_attention, num_decode_splits
from ember.kernels.mla_decode import mla_block_h, mla_decode, mla_head_blocks

LATENT, ROPE = 512, 64


def case(batch: int, heads: int, lo: int, hi: int, page: int, kv_dtype: torch.dtype, seed: int = 0):
    """q, the one-plane cache, shuffled block tables, seq lens and the bytes of KV one step reads."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    per = (lens + page - 1) // page
    num_blocks = int(per.sum()) + 8
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, int(per.max()), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per.tolist()):
        tables[i, :n] = order[at:at + n]
        at += n
    cache = torch.randn(num_blocks, page, 1, LATENT + ROPE, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    q = torch.randn(batch, heads, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
    nbytes = int(lens.sum()) * (LATENT + ROPE) * cache.element_size()
    return q, cache, tables.cuda(), lens.to(torch.int32).cuda(), nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", nargs="?", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lo", type=int, default=1000)
    ap.add_argument("--hi", type=int, default=2000)
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--sweep", action="store_true", help="the MLA kernel at other tiles too")
    ns = ap.parse_args()
    kv_dtype = torch.float8_e4m3fn if ns.dtype == "fp8" else torch.bfloat16
    q, cache, tables, lens, nbytes = case(ns.batch, ns.heads, ns.lo, ns.hi, ns.page, kv_dtype)
    scale = (128 + ROPE) ** -0.5
    print(f"MLA decode, {ns.heads} heads, {LATENT} + {ROPE} dims, batch {ns.batch}, contexts U[{ns.lo}, {ns.hi}], "
          f"page {ns.page}, {kv_dtype}: {nbytes / 1e9:.3f} GB of KV a step")

    def report(name: str, ms: float, out: torch.Tensor | None = None) -> None:
        diff = "" if out is None else f"  max |diff| {(out.float() - want).abs().max().item():.2e}"
        print(f"  {name:44s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:6.0f} GB/s{diff}")

    generic_splits = num_decode_splits(ns.batch, 1)
    generic = lambda: decode_attention(q, cache, cache, tables, lens, scale, generic_splits)  # noqa: E731
    want = generic()[..., :LATENT].float()
    report(f"generic decode_attention ({generic_splits} splits)", do_bench(generic, warmup=10, rep=50))

    splits = num_decode_splits(ns.batch, mla_head_blocks(ns.heads))
    mla = lambda: mla_decode(q, cache, tables, lens, scale, LATENT, splits)  # noqa: E731
    report(f"mla_decode ({splits} splits, BLOCK_H {mla_block_h(ns.heads)})", do_bench(mla, warmup=10, rep=50), mla())

    if not ns.sweep:
        return
    print("  mla_decode at other tiles (BLOCK_H, BLOCK_N, warps, stages):")
    for bh, bn, nw, st in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3)):
        if bh > 16 and ns.heads <= 16 or ns.page % bn:
            continue
        run = lambda: mla_decode(q, cache, tables, lens, scale, LATENT,  # noqa: E731
                                 num_decode_splits(ns.batch, -(-ns.heads // bh)), block_h=bh, block_n=bn,
                                 num_warps=nw, num_stages=st)
        try:
            out = run()
            report(f"  {bh}, {bn}, {nw}, {st}", do_bench(run, warmup=5, rep=20), out)
        except Exception as e:  # out of shared memory or registers
            print(f"    {bh}, {bn}, {nw}, {st}: {type(e).__name__}")


if __name__ == "__main__":
    main()
