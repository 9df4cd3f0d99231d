"""Probe for one request at Llama-8B (goal 250 tok/s = 4.0 ms a step; ember 217): how much of
a decode step's matmul time is lost at the ~130 kernel boundaries, and does programmatic
dependent launch (PDL: the next kernel starts while the previous one drains, and reads its
first weight tile before waiting for the previous kernel's output) win it back?

Times the 32 layers' matmuls of one step (q|k|v, o, gate|up, down, each reading the previous
one's output, distinct weights per layer so nothing stays in L2), replayed from a CUDA graph:
  cublas       F.linear
  skinny       a tensor-core GEMV (one row padded to 16, weight as the dot's A operand)
  skinny+pdl   the same kernel launched with PDL: its first weight tile is loaded before
               griddepcontrol.wait; its dependents may launch once its programs have
               issued their last loads (-early: at once, which ran 35 % slower than no PDL:
               the waiting programs take the SMs that the running kernel's later ones need)
and checks that the PDL chain gives the skinny chain's exact output.
`python3 benchmarks/scripts/pdl_probe.py` (CUDA, sm90)."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from step_chain import HIDDEN, INTER, LAYERS, QKV, layer_weights

# (BLOCK_N, BLOCK_K, warps, stages) per shape, from skinny_gemm_probe.py on the H200
CONFIGS = {QKV: (64, 128, 4, 4), HIDDEN: (32, 256, 4, 3), 2 * INTER: (64, 128, 4, 4)}


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    w = tl.load(w_ptr + n[:, None] * stride_w + kk[None, :], mask=nmask[:, None], other=0.0)
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()  # the previous kernel's output (x) is complete and visible past this point
    xt = tl.load(x_ptr + kk[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0)
    acc = tl.dot(w, xt, acc)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + kk
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=nmask[:, None], other=0.0)
        xt = tl.load(x_ptr + k[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    if PDL:
        if not EARLY:  # the dependents launch as this kernel's programs finish their loads
            gdc_launch_dependents()
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nmask)


def skinny(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, pdl: bool, early: bool = False) -> None:
    n, k = w.shape
    bn, bk, warps, stages = CONFIGS[n]
    _skinny_kernel[(triton.cdiv(n, bn),)](x, w, y, n, w.stride(0), K=k, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, EARLY=early,
                                          num_warps=warps, num_stages=stages, launch_pdl=pdl)


def main() -> None:
    from gemv_bench import time_us

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    layers = [list(ws.values()) for ws in layer_weights(dev=dev, dt=dt)]
    nbytes = sum(w.numel() * 2 for ws in layers for w in ws)
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    bufs = [torch.empty(1, n, device=dev, dtype=dt) for n in (QKV, HIDDEN, 2 * INTER, HIDDEN)]

    def chain(kind: str) -> torch.Tensor:
        x = x0
        for ws in layers:
            for w, y in zip(ws, bufs):
                inp = x[:, :w.shape[1]]
                if kind == "cublas":
                    torch.matmul(inp, w.t(), out=y)
                else:
                    skinny(inp, w, y, pdl=kind.startswith("skinny+pdl"), early=kind.endswith("early"))
                x = y
        return x

    outs = {}
    for kind in ("cublas", "skinny", "skinny+pdl", "skinny+pdl-early"):
        try:
            outs[kind] = chain(kind).float().clone()
            us = time_us(lambda i: chain(kind), copies=1, reps=1)  # one chain a graph, replayed
            print(f"{kind:11s}: {us:8.1f} us a step for {LAYERS} layers ({us / LAYERS:6.1f} a layer), "
                  f"{nbytes / us / 1e6:5.2f} TB/s of weights", flush=True)
        except Exception as e:  # PDL inside a graph may be unsupported
            print(f"{kind:11s}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if "skinny" in outs and "skinny+pdl" in outs:
        same = [torch.equal(outs["skinny"], outs[k]) for k in ("skinny+pdl", "skinny+pdl-early") if k in outs]
        print(f"skinny+pdl outputs identical to skinny's: {same}; "
              f"skinny vs cublas max diff {(outs['skinny'] - outs['cublas']).abs().max().item():.3g}")
    del layers


if __name__ == "__main__":
    main()
