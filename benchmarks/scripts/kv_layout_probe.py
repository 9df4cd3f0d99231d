"""Probe: does the paged KV cache's layout decide the fp8 decode kernel's speed? A decode
kernel (one split, flash-decoding's stage 1 with the output written directly) over four
cache layouts, at the nano-vllm (Qwen3-0.6B, batch 256) and Llama-8B (batch 512) shapes,
fp8 and bf16:

  nhd16   K, V [blocks, 16, Hkv, D]; 128-position tiles, one block-table read per position
          (ember's layout and kernel today)
  nhdP    K, V [blocks, P, Hkv, D] with P = BLOCK_N: one block id per tile
  hndP    K, V [blocks, Hkv, P, D]: a tile of one head is one contiguous run
  hnd_vt  K [blocks, Hkv, P, D], V^T [blocks, Hkv, D, P]: V's positions contiguous, so the
          P @ V dot pairs adjacent bytes (the fp8 tile's slow path is V's strided pairs)

Each layout is checked against a torch reference on a few sequences.
`python3 benchmarks/scripts/kv_layout_probe.py`"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

LOG2E = 1.4426950408889634


@triton.jit
def _probe_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, o_ptr, scale_log2, stride_tb,
                  sk_b, sk_p, sk_h, sv_b, sv_p, sv_h, sv_d,
                  GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE: tl.constexpr, PER_TILE: tl.constexpr, FP16: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    hmask = rows < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * GROUP * tl.num_programs(1) + heads[:, None]) * D + d[None, :], mask=hmask[:, None],
                other=0.0)
    if FP16:
        q = q.to(tl.float16)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    nn = tl.arange(0, BLOCK_N)
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + nn
        pmask = pos < seq_len
        if PER_TILE:  # the tile is one page: one block id
            blk = tl.load(tables_ptr + b * stride_tb + n0 // PAGE).to(tl.int64)
            k_off = blk * sk_b + nn * sk_p + kvh * sk_h
            v_off = blk * sv_b + nn * sv_p + kvh * sv_h
        else:
            blk = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=pmask, other=0).to(tl.int64)
            k_off = blk * sk_b + (pos % PAGE) * sk_p + kvh * sk_h
            v_off = blk * sv_b + (pos % PAGE) * sv_p + kvh * sv_h
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=pmask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :] * sv_d, mask=pmask[:, None], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * scale_log2
        qk = tl.where(pmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + (b * GROUP * tl.num_programs(1) + heads[:, None]) * D + d[None, :], out, mask=hmask[:, None])


def make_case(batch, heads, kv_heads, lo, hi, layout, dtype, dim=128, seed=0):
    page = 16 if layout == "nhd16" else 128
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    per = (lens + page - 1) // page
    num_blocks = int(per.sum()) + 4
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, int(per.max()), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per.tolist()):
        tables[i, :n] = order[at:at + n]
        at += n
    shape = (num_blocks, page, kv_heads, dim) if layout.startswith("nhd") else (num_blocks, kv_heads, page, dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(dtype)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(dtype)
    if layout == "hnd_vt":
        v = v.transpose(2, 3).contiguous()  # [blocks, Hkv, D, P]
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    nbytes = int(lens.sum()) * kv_heads * dim * 2 * k.element_size()
    return q, k, v, tables.cuda(), lens.to(torch.int32).cuda(), page, nbytes


def strides(layout, k, v):
    """(sk_b, sk_p, sk_h), (sv_b, sv_p, sv_h, sv_d) in elements."""
    if layout.startswith("nhd"):
        return (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2), 1)
    if layout == "hndP":
        return (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), v.stride(2), v.stride(1), 1)
    return (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), 1, v.stride(1), v.stride(2))  # V^T


def run(q, k, v, tables, lens, page, layout, block_n, warps, stages):
    batch, heads, dim = q.shape
    kv_heads = k.shape[2] if layout.startswith("nhd") else k.shape[1]
    group = heads // kv_heads
    out = torch.empty(batch, heads, dim, device="cuda", dtype=torch.float32)
    (sk_b, sk_p, sk_h), (sv_b, sv_p, sv_h, sv_d) = strides(layout, k, v)
    _probe_kernel[(batch, kv_heads)](q, k, v, tables, lens, out, 0.088 * LOG2E, tables.stride(0),
                                     sk_b, sk_p, sk_h, sv_b, sv_p, sv_h, sv_d,
                                     GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim,
                                     BLOCK_N=block_n, PAGE=page, PER_TILE=layout != "nhd16",
                                     FP16=k.dtype == torch.float8_e4m3fn, num_warps=warps, num_stages=stages)
    return out


def reference(q, k, v, tables, lens, page, layout, seqs=4):
    outs = []
    for b in range(seqs):
        n = int(lens[b])
        blocks = tables[b, :(n + page - 1) // page].long()
        if layout.startswith("nhd"):
            kk = k[blocks].float().reshape(-1, k.shape[2], k.shape[3])[:n]
            vv = v[blocks].float().reshape(-1, v.shape[2], v.shape[3])[:n]
        else:
            kk = k[blocks].float().permute(0, 2, 1, 3).reshape(-1, k.shape[1], k.shape[3])[:n]
            vb = v[blocks].float()
            vv = (vb.permute(0, 3, 1, 2) if layout == "hnd_vt" else vb.permute(0, 2, 1, 3)).reshape(
                -1, kk.shape[1], kk.shape[2])[:n]
        group = q.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kk) * 0.088
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


def main():
    shapes = {"qwen3-0.6b bs256 ctx U[100,2048]": (256, 16, 8, 100, 2048),
              "llama-8b bs512 ctx U[1000,2000]": (512, 32, 8, 1000, 2000)}
    configs = {"nhd16": [(128, 4, 4), (128, 4, 3)], "nhdP": [(128, 4, 4), (128, 4, 3)],
               "hndP": [(128, 4, 4), (128, 4, 3), (128, 8, 3)], "hnd_vt": [(128, 4, 4), (128, 4, 3), (128, 8, 3)]}
    for name, shape in shapes.items():
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            print(f"{name} {str(dtype)[6:]}", flush=True)
            for layout, cfgs in configs.items():
                q, k, v, tables, lens, page, nbytes = make_case(*shape, layout, dtype)
                ref = reference(q, k, v, tables, lens, page, layout)
                for bn, w, st in cfgs:
                    try:
                        out = run(q, k, v, tables, lens, page, layout, bn, w, st)
                        err = (out[:4] - ref).abs().max().item()
                        ms = do_bench(lambda: run(q, k, v, tables, lens, page, layout, bn, w, st), warmup=5, rep=25)
                        print(f"  {layout:7s} {bn},{w},{st}: {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s "
                              f"err {err:.1e}", flush=True)
                    except Exception as e:
                        print(f"  {layout:7s} {bn},{w},{st}: {type(e).__name__} {str(e)[:100]}", flush=True)
                del q, k, v
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
