"""Probe for the next GEMV: does a tensor-core "skinny GEMM" (y^T = W x^T with the rows of x
padded to 16, W streamed through Triton's software pipeline as the dot's A operand) read
big weights at cuBLAS's speed or better, at 1 to 16 rows? ember's GEMV (kernels/gemv.py:
FMAs, no pipelined loads) lost to cuBLAS on the H200 above 2^24-element weights (3.0-3.65
vs 3.1-4.3 TB/s) and from 2 rows up. If this wins, the GEMV path can take Llama-8B's layers
(one request: 213 tok/s, goal 250) and batches up to 16 (the nano-vllm run's tail).

Times cuBLAS, ember's GEMV (one row) and the probe kernel over a small config grid at the
Qwen3-0.6B / Llama-8B decode shapes, inside CUDA graphs, as gemv_bench.py does.
`python3 benchmarks/scripts/skinny_gemm_probe.py` (CUDA); `... --modes` times how the dot's B
operand is built (see `modes`); `... --check` compares the kernel with F.linear at small
shapes (it passed on Triton's interpreter, with the NumPy fix of tests/kernels/conftest.py
loaded)."""

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, M, N, K, stride_x, stride_w, stride_y, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr = 0):
    """MODE 0: x^T loaded straight into the dot's B operand. 1: x loaded as [rows, BLOCK_K]
    and transposed in registers. 2: as 1, with a norm-like prologue (x * 1.1 rounded, times a
    weight vector, rounded), as ember's fused GEMV builds its activations. 3 (one row only):
    the same prologue on the one real row, then placed in column 0 of the padded operand."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        if MODE == 0:
            xt = tl.load(x_ptr + m[None, :] * stride_x + k[:, None], mask=(m < M)[None, :] & (k < K)[:, None],
                         other=0.0)
        elif MODE == 3:
            x1 = tl.load(x_ptr + k, mask=k < K, other=0.0)
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            a1 = (nw * (x1.to(tl.float32) * 1.1).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            xt = tl.where((m == 0)[None, :], a1[:, None], 0.0).to(x1.dtype)
        else:
            x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
            if MODE == 2:
                nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                x = (nw[None, :] * (x.to(tl.float32) * 1.1).to(x.dtype).to(tl.float32)).to(x.dtype)
            xt = tl.trans(x)
        acc = tl.dot(w, xt, acc)
    tl.store(y_ptr + m[None, :] * stride_y + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[None, :] & (n < N)[:, None])


def skinny(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 128, warps: int = 4,
           stages: int = 4, mode: int = 0, nw: torch.Tensor | None = None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](x, w, y, x if nw is None else nw, m, n, k, x.stride(0), w.stride(0),
                                                y.stride(0), BLOCK_M=max(16, triton.next_power_of_2(m)),
                                                BLOCK_N=block_n, BLOCK_K=block_k, MODE=mode, num_warps=warps,
                                                num_stages=stages)
    return y


def modes() -> None:
    """Why ember's fused tensor-core GEMV ran 2x slower than this kernel in the engine
    (BENCHMARKS.md, session 5): the MODEs at the 8B / 0.6B shapes, one and 8 rows. Modes 0-2
    ran on the H200 in session 5 (the prologue's arithmetic on 16 padded rows was the cost);
    mode 3 was added after, for the next session."""
    from gemv_bench import SHAPES, time_us

    torch.manual_seed(0)
    print("shape          M   cuBLAS   mode0   mode1   mode2   mode3  (us; mode 0: x^T from memory, 1: via "
          "registers, 2: via registers with a norm-like prologue, 3: the prologue on the one real row)")
    for name in ("8b qkv", "8b gate_up", "8b o", "0.6b qkv", "0.6b o"):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(1, -(-400_000_000 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        cfg = (64, 128, 4, 4) if 2 * n >= 3 * k else (32, 256, 4, 3)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = [time_us(lambda i: F.linear(x, ws[i]), copies)]
            for mode in (0, 1, 2, 3) if m == 1 else (0, 1, 2):
                row.append(time_us(lambda i: skinny(x, ws[i], *cfg, mode=mode, nw=nw), copies, reps=20))
            print(f"{name:14s} {m:2d} " + " ".join(f"{t:7.1f}" for t in row), flush=True)
        del ws
        torch.cuda.empty_cache()


def check() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 70, 96), (3, 64, 256), (16, 40, 130)]:
        x = torch.randn(m, k, generator=g).to(device)
        w = torch.randn(n, k, generator=g).to(device)
        for mode in (0, 1, 2, 3) if m == 1 else (0, 1, 2):
            got = skinny(x, w, block_n=16, block_k=32, stages=2, mode=mode, nw=torch.ones(k, device=device))
            torch.testing.assert_close(got, F.linear(x * (1.1 if mode >= 2 else 1.0), w), atol=2e-2, rtol=2e-2)
    print("skinny kernel matches F.linear in every mode")


def main() -> None:
    from gemv_bench import SHAPES, time_us

    from ember.kernels.gemv import gemv

    torch.manual_seed(0)
    grid = [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 4)]
    print("shape          M   cuBLAS  ember-gemv  skinny best (BLOCK_N, BLOCK_K, warps, stages)   us; TB/s of weight")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, -(-400_000_000 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            t_blas = time_us(lambda i: F.linear(x, ws[i]), copies)
            t_gemv = time_us(lambda i: gemv(x, ws[i]), copies) if m == 1 else float("nan")
            rows = []
            for cfg in grid:
                try:
                    err = (skinny(x, ws[0], *cfg).float() - want).abs().max().item()
                    assert err < 0.05, f"differs by {err}"
                    rows.append((time_us(lambda i: skinny(x, ws[i], *cfg), copies, reps=20), cfg))
                except Exception as e:  # out of resources
                    print(f"    {cfg}: {type(e).__name__} {str(e)[:80]}")
            rows.sort()
            best = rows[0] if rows else (float("nan"), None)
            print(f"{name:14s} {m:2d} {t_blas:8.1f} {t_gemv:11.1f} {best[0]:9.1f} {best[1]}   "
                  f"TB/s {nbytes / t_blas / 1e6:.2f} / {nbytes / t_gemv / 1e6:.2f} / {nbytes / best[0] / 1e6:.2f}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    check() if "--check" in sys.argv else modes() if "--modes" in sys.argv else main()
