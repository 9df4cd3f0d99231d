"""Probe for one request at Llama-8B: is a persistent kernel (a "megakernel") the way past
the per-kernel cost of the step's matmuls?

Measured so far (BENCHMARKS.md, session 6): the 32 layers' matmuls cost 4.0 ms a step as
128 kernels (4.0 TB/s); each kernel pays a ramp and a tail (q|k|v 3.1 TB/s, o 2.8), and
neither PDL nor warming L2 won that back. Here ONE launch runs the whole chain: programs
= SMs x PER_SM, each owning a slice of every matmul's output rows; between two matmuls a
grid barrier (a counter in global memory: arrive with a release, spin, acquire). Before
it waits at a barrier, a program loads its first weight tile of the next matmul, which
does not depend on the barrier, so HBM has work while the grid gathers.

Prints the chain's time against cuBLAS's (the same weights, 128 kernels in a CUDA graph)
and the largest difference of the outputs. No small kernels in between: it bounds what a
megakernel could win on the matmuls alone.
`python3 benchmarks/scripts/persistent_chain_probe.py` (CUDA); `--check`: one program on
Triton's interpreter (a grid barrier needs programs that run at once)."""

import sys

import torch
import triton
import triton.language as tl

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 14336, 32


@triton.jit
def _grid_barrier(bar_ptr, target):
    tl.debug_barrier()  # every thread's stores before the arrival's release
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    while tl.load(bar_ptr, volatile=True) < target:
        pass
    tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _load_w(w_ptr, t, k0, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n = t * BN + tl.arange(0, BN)
    return tl.load(w_ptr + n[:, None] * K + k0 + tl.arange(0, BK)[None, :], mask=(n < N)[:, None], other=0.0)


@triton.jit
def _matvec(x_ptr, w_ptr, y_ptr, w_first, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[N] = W[N, K] x for the tiles pid, pid + G, ...; w_first: this program's first tile's
    first [BN, BK] block, already loaded. x comes from other programs: read past L1 (.cg)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    tiles = tl.cdiv(N, BN)
    if pid < tiles:
        acc = tl.dot(w_first, _xt(x_ptr, 0, BK), tl.zeros([BN, 16], tl.float32))
        _finish_tile(x_ptr, w_ptr, y_ptr, pid, BK, acc, N, K, BN, BK)
    for t in range(pid + grid, tiles, grid):
        _finish_tile(x_ptr, w_ptr, y_ptr, t, 0, tl.zeros([BN, 16], tl.float32), N, K, BN, BK)


@triton.jit
def _xt(x_ptr, k0, BK: tl.constexpr):
    """x[k0 : k0 + BK] as column 0 of a [BK, 16] operand."""
    col = tl.arange(0, 16)
    return tl.load(x_ptr + k0 + tl.arange(0, BK)[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _finish_tile(x_ptr, w_ptr, y_ptr, t, k_from, acc, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    for k0 in range(k_from, K, BK):
        acc = tl.dot(_load_w(w_ptr, t, k0, N, K, BN, BK), _xt(x_ptr, k0, BK), acc)
    n = t * BN + tl.arange(0, BN)
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _chain_kernel(x_ptr, qkv_w, o_w, gu_w, down_w, qkv_y, o_y, gu_y, down_y, bar_ptr, layers,
                  H: tl.constexpr, QKV_N: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BN_O: tl.constexpr, BK_O: tl.constexpr):
    """x -> [q|k|v -> o -> gate|up -> down] x layers; o and down read the first H / I
    columns of the previous output (as the stand-in for attention and SiLU)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    nbar = 0
    src = x_ptr
    w = _load_w(qkv_w, pid, 0, QKV_N, H, BN, BK)
    one = tl.full([], 1, tl.int64)
    for layer32 in range(layers):
        layer = layer32 * one  # int64: a layer's offset into the stacked weights passes 2^31 elements
        _matvec(src, qkv_w + layer * QKV_N * H, qkv_y, w, QKV_N, H, BN, BK)
        w_o = _load_w(o_w + layer * H * H, pid, 0, H, H, BN_O, BK_O)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        _matvec(qkv_y, o_w + layer * H * H, o_y, w_o, H, H, BN_O, BK_O)
        w = _load_w(gu_w + layer * 2 * I * H, pid, 0, 2 * I, H, BN, BK)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        _matvec(o_y, gu_w + layer * 2 * I * H, gu_y, w, 2 * I, H, BN, BK)
        w_d = _load_w(down_w + layer * H * I, pid, 0, H, I, BN_O, BK_O)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        _matvec(gu_y, down_w + layer * H * I, down_y, w_d, H, I, BN_O, BK_O)
        if layer + 1 < layers:
            w = _load_w(qkv_w + (layer + 1) * QKV_N * H, pid, 0, QKV_N, H, BN, BK)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        src = down_y


def make(layers: int, h: int, qkv: int, inter: int, dev: str, dt: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(layers, n, k, generator=g) / k ** 0.5).to(dev, dt)

    return {"qkv": w(qkv, h), "o": w(h, h), "gate_up": w(2 * inter, h), "down": w(h, inter)}


def resident_per_sm(x, ws, bufs, bar, bn, bk, bn_o, bk_o, warps, stages) -> int:
    """How many programs of this config an SM holds at once (by registers, shared memory,
    threads): a grid barrier over more programs than fit would never open."""
    layers, qkv_n, h = ws["qkv"].shape
    k = _chain_kernel.warmup(x, ws["qkv"], ws["o"], ws["gate_up"], ws["down"], *bufs, bar, layers, H=h, QKV_N=qkv_n,
                             I=ws["down"].shape[2], BN=bn, BK=bk, BN_O=bn_o, BK_O=bk_o, num_warps=warps,
                             num_stages=stages, grid=(1,))
    k._init_handles()
    props = torch.cuda.get_device_properties(0)
    threads = 32 * warps
    by_regs = 65536 // max(1, k.n_regs * threads)
    by_smem = (props.shared_memory_per_multiprocessor - 1024) // max(1, k.metadata.shared + 1024)
    return min(by_regs, by_smem, 2048 // threads, 32)


def run_chain(x: torch.Tensor, ws: dict[str, torch.Tensor], bufs: list[torch.Tensor], bar: torch.Tensor,
              programs: int, bn: int, bk: int, bn_o: int, bk_o: int, warps: int, stages: int) -> torch.Tensor:
    layers, qkv_n, h = ws["qkv"].shape
    inter = ws["down"].shape[2]
    bar.zero_()
    _chain_kernel[(programs,)](x, ws["qkv"], ws["o"], ws["gate_up"], ws["down"], *bufs, bar, layers, H=h,
                               QKV_N=qkv_n, I=inter, BN=bn, BK=bk, BN_O=bn_o, BK_O=bk_o, num_warps=warps,
                               num_stages=stages)
    return bufs[3]


def reference(x: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
    h, inter = ws["o"].shape[1], ws["down"].shape[2]
    for i in range(ws["qkv"].shape[0]):
        y = x @ ws["qkv"][i].t()
        y = y[:, :h] @ ws["o"][i].t()
        y = y @ ws["gate_up"][i].t()
        x = y[:, :inter] @ ws["down"][i].t()
    return x


def bufs_for(ws: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty(1, ws[k].shape[1], device=x.device, dtype=x.dtype) for k in ("qkv", "o", "gate_up", "down")]


def check() -> None:
    """One program on the interpreter, fp16 (its bf16 dot is broken): the chain's arithmetic."""
    ws = make(2, 64, 96, 96, "cpu", torch.float16)  # K a multiple of BK, as at real shapes
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)).half()
    bar = torch.zeros(1, dtype=torch.int32)
    got = run_chain(x, ws, bufs_for(ws, x), bar, 1, 32, 32, 16, 32, 4, 1).float()
    want = reference(x.float(), {k: v.float() for k, v in ws.items()})
    print("max diff", (got - want).abs().max().item(), "of", want.abs().max().item(), "barrier", bar.item())


def main() -> None:
    from gemv_bench import time_us

    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = make(LAYERS, HIDDEN, QKV, INTER, dev, dt)
    nbytes = sum(w.numel() * 2 for w in ws.values())
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    bufs = bufs_for(ws, x)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    want = reference(x.float(), {k: v.float() for k, v in ws.items()})
    flat = [w for name in ("qkv", "o", "gate_up", "down") for w in [ws[name]]]
    outs = [torch.empty(1, n, device=dev, dtype=dt) for n in (QKV, HIDDEN, 2 * INTER, HIDDEN)]

    def cublas(i: int) -> None:
        y = x
        for layer in range(LAYERS):
            for j, w in enumerate(flat):
                torch.matmul(y[:, :w.shape[2]], w[layer].t(), out=outs[j])
                y = outs[j]

    us = time_us(cublas, copies=1, reps=1)
    print(f"cuBLAS, 128 kernels: {us:8.1f} us a step ({nbytes / us / 1e6:5.2f} TB/s of weights)", flush=True)
    for per_sm, bn, bk, bn_o, bk_o, warps, stages in ((1, 64, 128, 32, 256, 4, 4), (2, 64, 128, 32, 256, 4, 4),
                                                      (1, 64, 128, 32, 128, 4, 4), (2, 32, 128, 32, 128, 4, 4),
                                                      (1, 128, 128, 64, 128, 8, 4), (3, 32, 128, 32, 128, 4, 3)):
        cfg = f"{per_sm}/SM BN {bn} BK {bk}, o/down BN {bn_o} BK {bk_o}, {warps} warps {stages} stages"
        try:
            try:
                fit = resident_per_sm(x, ws, bufs, bar, bn, bk, bn_o, bk_o, warps, stages)
            except Exception as e:  # the occupancy query failed: only one program an SM is safe
                print(f"   (occupancy unknown: {type(e).__name__}: {str(e)[:120]})", flush=True)
                fit = 1
            if fit < per_sm:
                print(f"persistent {cfg}: only {fit} program(s) fit an SM, skipped", flush=True)
                continue
            got = run_chain(x, ws, bufs, bar, per_sm * sms, bn, bk, bn_o, bk_o, warps, stages).float()
            torch.cuda.synchronize()
            err = ((got - want).abs().max() / want.abs().max()).item()
            us = time_us(lambda i: run_chain(x, ws, bufs, bar, per_sm * sms, bn, bk, bn_o, bk_o, warps, stages),
                         copies=1, reps=1)
            print(f"persistent {cfg}: {us:8.1f} us a step ({nbytes / us / 1e6:5.2f} TB/s), "
                  f"relative error {err:.2e}", flush=True)
        except Exception as e:
            print(f"persistent {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
