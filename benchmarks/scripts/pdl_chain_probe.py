"""Probe for one request at Llama-8B (goal 4.0 ms a step, ember 4.6): can programmatic
dependent launch (PDL) hide the cost of a kernel boundary when every kernel of the step
takes part?

pdl_probe.py launched only the matmuls with PDL (+1 %), and triggering the dependents at a
kernel's start ran 35 % slower: the waiting programs took the SMs that the running grid's
later waves needed. Here each matmul runs in one wave (a program per SM or two, each
owning whole output tiles), so waiting programs take no running grid's place; every kernel
triggers its dependents at once, then loads its first weight tiles, then waits
(griddepcontrol.wait) for the previous kernel's output. The small kernels between the
matmuls are stand-ins that spin on one SM for the time the real ones take (RoPE +
attention 9 µs, norm 2, SiLU 1.6), launched the same way.

Each chain is 32 layers of q|k|v -> 9 µs -> o -> 2 µs -> gate|up -> 1.6 µs -> down -> 2 µs,
distinct weights per layer, replayed from a CUDA graph; outputs are compared with the
chain without PDL. `python3 benchmarks/scripts/pdl_chain_probe.py` (CUDA, sm90)."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from step_chain import HIDDEN, INTER, QKV, Spinner, layer_weights

BLOCK = {QKV: (64, 128), HIDDEN: (32, 256), 2 * INTER: (64, 128)}  # (BLOCK_N, BLOCK_K), skinny_gemm_probe's best


@triton.jit
def _tile(x_ptr, w_ptr, y_ptr, n, nmask, kk, col, stride_w, acc, K: tl.constexpr, K_FROM: tl.constexpr,
          BLOCK_K: tl.constexpr):
    for k0 in range(K_FROM, K, BLOCK_K):
        k = k0 + kk
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=nmask[:, None], other=0.0)
        xt = tl.load(x_ptr + k[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _wave_kernel(x_ptr, w_ptr, y_ptr, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRE: tl.constexpr, PDL: tl.constexpr):
    """y = W x for one row; program p owns tiles p, p + G, ...; the first PRE weight tiles of
    its first tile are loaded before waiting for x."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, 16)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    if PDL:
        gdc_launch_dependents()
    w0 = tl.load(w_ptr + n[:, None] * stride_w + kk[None, :], mask=nmask[:, None], other=0.0)
    if PRE == 2:
        w1 = tl.load(w_ptr + n[:, None] * stride_w + BLOCK_K + kk[None, :], mask=nmask[:, None], other=0.0)
    if PDL:
        gdc_wait()
    xt0 = tl.load(x_ptr + kk[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0)
    acc = tl.dot(w0, xt0, tl.zeros([BLOCK_N, 16], tl.float32))
    if PRE == 2:
        xt1 = tl.load(x_ptr + BLOCK_K + kk[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0)
        acc = tl.dot(w1, xt1, acc)
    _tile(x_ptr, w_ptr, y_ptr, n, nmask, kk, col, stride_w, acc, K, PRE * BLOCK_K, BLOCK_K)
    for t in range(pid + grid, tl.cdiv(N, BLOCK_N), grid):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        _tile(x_ptr, w_ptr, y_ptr, n, n < N, kk, col, stride_w, tl.zeros([BLOCK_N, 16], tl.float32), K, 0,
              BLOCK_K)


def main() -> None:
    from gemv_bench import time_us

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers = [list(ws.values()) for ws in layer_weights(dev=dev, dt=dt)]
    nbytes = sum(w.numel() * 2 for ws in layers for w in ws)
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    bufs = [torch.empty(1, n, device=dev, dtype=dt) for n in (QKV, HIDDEN, 2 * INTER, HIDDEN)]
    spin = Spinner()
    spins_after = {0: 9.0, 1: 2.0, 2: 1.6, 3: 2.0}  # after q|k|v, o, gate|up, down

    def wave(x, w, y, per_sm, pre, pdl):
        n, k = w.shape
        bn, bk = BLOCK[n]
        grid = min(triton.cdiv(n, bn), per_sm * sms)
        _wave_kernel[(grid,)](x, w, y, n, w.stride(0), K=k, BLOCK_N=bn, BLOCK_K=bk, PRE=pre, PDL=pdl,
                              num_warps=4, num_stages=4, launch_pdl=pdl)

    def chain(kind: str, per_sm: int = 1, pre: int = 1, pdl: bool = False, spins: bool = True):
        x = x0
        for ws in layers:
            for j, (w, y) in enumerate(zip(ws, bufs)):
                inp = x[:, :w.shape[1]]
                if kind == "cublas":
                    torch.matmul(inp, w.t(), out=y)
                else:
                    wave(inp, w, y, per_sm, pre, pdl)
                x = y
                if spins:
                    spin(spins_after[j], pdl)
        return x

    runs = [("cublas, no stand-ins", dict(kind="cublas", spins=False)), ("cublas", dict(kind="cublas"))]
    for per_sm in (1, 2, 4):
        for pre in (1, 2):
            for pdl in (False, True):
                runs.append((f"wave {per_sm}/SM pre {pre} pdl {pdl}", dict(kind="wave", per_sm=per_sm, pre=pre,
                                                                           pdl=pdl)))
    runs.append(("wave 2/SM pre 2 pdl True, no stand-ins", dict(kind="wave", per_sm=2, pre=2, pdl=True,
                                                                  spins=False)))
    ref = chain("wave", 1, 1, False).float().clone()
    print(f"cublas vs wave max diff {(chain('cublas').float() - ref).abs().max().item():.3g}", flush=True)
    for name, kw in runs:
        try:
            same = torch.equal(chain(**kw).float(), ref) if kw["kind"] == "wave" else "-"
            us = time_us(lambda i: chain(**kw), copies=1, reps=1)
            print(f"{name:42s} {us:8.1f} us a step ({nbytes / us / 1e6:5.2f} TB/s of weights), same as no-PDL "
                  f"wave: {same}", flush=True)
        except Exception as e:
            print(f"{name:42s} {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
