"""Probe for one request at Llama-8B: is a persistent kernel (a "megakernel") the way past
the per-kernel cost of the step's matmuls?

Measured so far (BENCHMARKS.md, session 6): the 32 layers' matmuls cost 3.75 ms a step as
128 cuBLAS kernels (3.72 TB/s); each kernel pays a ramp and a tail (q|k|v 3.1 TB/s, o 2.8),
and neither PDL nor warming L2 won that back. Here ONE launch runs the whole chain: programs
= SMs x PER_SM, each owning a slice of every matmul's output rows; between two matmuls a
grid barrier (a counter in global memory: arrive with a release, spin, acquire). Before
it waits at a barrier, a program loads its first weight tile of the next matmul, which
does not depend on the barrier, so HBM has work while the grid gathers.

Prints the chain's time against cuBLAS's (the same weights, 128 kernels in a CUDA graph)
and the largest difference of the outputs. Two persistent kernels: one that gives each
program whole output tiles (uneven: q|k|v has 96 tiles of 64 rows for 132 SMs), and one
that splits K so every program streams the same bytes, adding its partial sums into
float32 outputs by atomics. No small kernels in between: it bounds what a
megakernel could win on the matmuls alone.
`python3 benchmarks/scripts/persistent_chain_probe.py` (CUDA); `--check`: one program on
Triton's interpreter (a grid barrier needs programs that run at once)."""

import sys

import torch
import triton
import triton.language as tl

from step_chain import HIDDEN, INTER, LAYERS, QKV


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


@triton.jit
def _x_block(x_ptr, k0, BK: tl.constexpr):
    """x[k0 : k0 + BK] (float32, written by other programs: read past L1) as column 0 of a
    [BK, 16] operand."""
    col = tl.arange(0, 16)
    return tl.load(x_ptr + k0 + tl.arange(0, BK)[:, None] + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _share(N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """This program's blocks [start, end) of the [N / BN, K / BK] grid of W's blocks, row
    tile by row tile: every program gets the same number, give or take one."""
    total = tl.cdiv(N, BN) * (K // BK)
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    return pid * total // grid, (pid + 1) * total // grid


@triton.jit
def _first_block(w_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    start, end = _share(N, K, BN, BK)
    return _load_w(w_ptr, start // (K // BK), (start % (K // BK)) * BK, N, K, BN, BK)


@triton.jit
def _flush(y_ptr, rt, acc, N, BN: tl.constexpr):
    n = rt * BN + tl.arange(0, BN)
    tl.atomic_add(y_ptr + n, tl.sum(acc, 1), mask=n < N, sem="relaxed")


@triton.jit
def _split_matvec(x_ptr, w_ptr, y_ptr, w_first, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y (float32, zeroed) += W x over this program's share of W's blocks: split-K, so every
    program streams the same bytes; a row tile's partial sum goes out by atomic adds."""
    KB: tl.constexpr = K // BK
    start, end = _share(N, K, BN, BK)
    acc = tl.zeros([BN, 16], tl.float32)
    if start < end:
        kb = start % KB
        acc = tl.dot(w_first, _x_block(x_ptr, kb * BK, BK).to(w_first.dtype), acc)
        if (kb == KB - 1) | (start + 1 == end):
            _flush(y_ptr, start // KB, acc, N, BN)
            acc = tl.zeros([BN, 16], tl.float32)
    for b in range(start + 1, end):
        rt = b // KB
        kb = b % KB
        w = _load_w(w_ptr, rt, kb * BK, N, K, BN, BK)
        acc = tl.dot(w, _x_block(x_ptr, kb * BK, BK).to(w.dtype), acc)
        if (kb == KB - 1) | (b + 1 == end):
            _flush(y_ptr, rt, acc, N, BN)
            acc = tl.zeros([BN, 16], tl.float32)


@triton.jit
def _balanced_chain_kernel(x_ptr, qkv_w, o_w, gu_w, down_w, qkv_y, o_y, gu_y, down_y, bar_ptr, layers,
                           H: tl.constexpr, QKV_N: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr):
    """As _chain_kernel, split-K: outputs are float32 sums in per-layer buffers [layers, N],
    zeroed before the launch; x is float32 too."""
    grid = tl.num_programs(0)
    nbar = 0
    src = x_ptr
    w = _first_block(qkv_w, QKV_N, H, BN, BK)
    one = tl.full([], 1, tl.int64)
    for layer32 in range(layers):
        layer = layer32 * one
        qkv = qkv_y + layer * QKV_N
        _split_matvec(src, qkv_w + layer * QKV_N * H, qkv, w, QKV_N, H, BN, BK)
        w = _first_block(o_w + layer * H * H, H, H, BN, BK)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        _split_matvec(qkv, o_w + layer * H * H, o_y + layer * H, w, H, H, BN, BK)
        w = _first_block(gu_w + layer * 2 * I * H, 2 * I, H, BN, BK)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        _split_matvec(o_y + layer * H, gu_w + layer * 2 * I * H, gu_y + layer * 2 * I, w, 2 * I, H, BN, BK)
        w_d = _first_block(down_w + layer * H * I, H, I, BN, BK)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        _split_matvec(gu_y + layer * 2 * I, down_w + layer * H * I, down_y + layer * H, w_d, H, I, BN, BK)
        if layer + 1 < layers:
            w = _first_block(qkv_w + (layer + 1) * QKV_N * H, QKV_N, H, BN, BK)
        nbar += 1
        _grid_barrier(bar_ptr, nbar * grid)
        src = down_y + layer * H


def run_balanced(x32: torch.Tensor, ws: dict[str, torch.Tensor], acc: list[torch.Tensor], bar: torch.Tensor,
                 programs: int, bn: int, bk: int, warps: int, stages: int) -> torch.Tensor:
    """x32 [1, H] float32; acc: float32 [layers, N] for q|k|v, o, gate|up, down. Returns the
    last layer's down output."""
    layers, qkv_n, h = ws["qkv"].shape
    for a in acc:
        a.zero_()
    bar.zero_()
    _balanced_chain_kernel[(programs,)](x32, ws["qkv"], ws["o"], ws["gate_up"], ws["down"], *acc, bar, layers, H=h,
                                        QKV_N=qkv_n, I=ws["down"].shape[2], BN=bn, BK=bk, num_warps=warps,
                                        num_stages=stages)
    return acc[3][-1:]


def acc_for(ws: dict[str, torch.Tensor], dev) -> list[torch.Tensor]:
    return [torch.zeros(ws[k].shape[0], ws[k].shape[1], device=dev) for k in ("qkv", "o", "gate_up", "down")]


def make(layers: int, h: int, qkv: int, inter: int, dev: str, dt: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(layers, n, k, generator=g) / k ** 0.5).to(dev, dt)

    return {"qkv": w(qkv, h), "o": w(h, h), "gate_up": w(2 * inter, h), "down": w(h, inter)}


def resident_per_sm(kernel, args: tuple, **meta) -> int:
    """How many programs of this kernel and config an SM holds at once (by registers, shared
    memory, threads): a grid barrier over more programs than fit would never open."""
    k = kernel.warmup(*args, grid=(1,), **meta)
    k._init_handles()
    props = torch.cuda.get_device_properties(0)
    threads = 32 * meta["num_warps"]
    by_regs = 65536 // max(1, k.n_regs * threads)
    by_smem = (props.shared_memory_per_multiprocessor - 1024) // max(1, k.metadata.shared + 1024)
    return min(by_regs, by_smem, 2048 // threads, 32)


def try_config(name: str, per_sm: int, kernel, args: tuple, meta: dict, launch, want: torch.Tensor,
               nbytes: int) -> None:
    """Time one persistent config if per_sm programs fit an SM (else the barrier would hang)."""
    from gemv_bench import time_us

    try:
        try:
            fit = resident_per_sm(kernel, args, **meta)
        except Exception as e:  # the occupancy query failed: only one program an SM is safe
            print(f"   (occupancy unknown: {type(e).__name__}: {str(e)[:120]})", flush=True)
            fit = 1
        if fit < per_sm:
            print(f"{name}: only {fit} program(s) fit an SM, skipped", flush=True)
            return
        got = launch().float()
        torch.cuda.synchronize()
        err = ((got - want).abs().max() / want.abs().max()).item()
        us = time_us(lambda i: launch(), copies=1, reps=1)
        print(f"{name}: {us:8.1f} us a step ({nbytes / us / 1e6:5.2f} TB/s), relative error {err:.2e}", flush=True)
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


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


def reference_f32(x: torch.Tensor, ws: dict[str, torch.Tensor]) -> torch.Tensor:
    """The chain with activations rounded to the weights' dtype before each matmul, as the
    balanced kernel's dot does, and kept in float32 between."""
    h, inter = ws["o"].shape[1], ws["down"].shape[2]
    dt = ws["qkv"].dtype
    for i in range(ws["qkv"].shape[0]):
        y = x.to(dt).float() @ ws["qkv"][i].float().t()
        y = y[:, :h].to(dt).float() @ ws["o"][i].float().t()
        y = y.to(dt).float() @ ws["gate_up"][i].float().t()
        x = y[:, :inter].to(dt).float() @ ws["down"][i].float().t()
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
    got = run_balanced(x.float(), ws, acc_for(ws, "cpu"), bar, 1, 32, 32, 4, 1)
    # float32 activations here (the engine would round them to its dtype)
    want = reference_f32(x.float(), {k: v.float() for k, v in ws.items()})
    print("balanced: max diff", (got - want).abs().max().item(), "of", want.abs().max().item(), "barrier", bar.item())


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
    separate = [[w[layer].clone() for w in flat] for layer in range(LAYERS)]

    def cublas_separate(i: int) -> None:
        y = x
        for layer in range(LAYERS):
            for j, w in enumerate(separate[layer]):
                torch.matmul(y[:, :w.shape[1]], w.t(), out=outs[j])
                y = outs[j]

    us = time_us(cublas_separate, copies=1, reps=1)
    print(f"cuBLAS, 128 kernels, a tensor each: {us:8.1f} us a step ({nbytes / us / 1e6:5.2f} TB/s)", flush=True)
    layers = ws["qkv"].shape[0]
    args = (x, ws["qkv"], ws["o"], ws["gate_up"], ws["down"], *bufs, bar, layers)
    for per_sm, bn, bk, bn_o, bk_o, warps, stages in ((1, 64, 128, 32, 256, 4, 4), (2, 64, 128, 32, 256, 4, 4),
                                                      (1, 64, 128, 32, 128, 4, 4)):
        meta = dict(H=HIDDEN, QKV_N=QKV, I=INTER, BN=bn, BK=bk, BN_O=bn_o, BK_O=bk_o, num_warps=warps,
                    num_stages=stages)
        try_config(f"persistent {per_sm}/SM BN {bn} BK {bk}, o/down BN {bn_o} BK {bk_o}, {warps} warps {stages} "
                   f"stages", per_sm, _chain_kernel, args, meta,
                   lambda: run_chain(x, ws, bufs, bar, per_sm * sms, bn, bk, bn_o, bk_o, warps, stages), want, nbytes)
    x32 = x.float()
    acc = acc_for(ws, dev)
    want32 = reference_f32(x32, ws)
    args = (x32, ws["qkv"], ws["o"], ws["gate_up"], ws["down"], *acc, bar, layers)
    for per_sm, bn, bk, warps, stages in ((1, 64, 128, 4, 4), (2, 64, 128, 4, 4), (1, 32, 256, 4, 4),
                                          (2, 32, 128, 4, 4), (1, 128, 128, 8, 4), (3, 32, 128, 4, 3),
                                          (4, 32, 128, 4, 3), (1, 64, 256, 8, 3)):
        meta = dict(H=HIDDEN, QKV_N=QKV, I=INTER, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
        try_config(f"balanced split-K {per_sm}/SM BN {bn} BK {bk}, {warps} warps {stages} stages", per_sm,
                   _balanced_chain_kernel, args, meta,
                   lambda: run_balanced(x32, ws, acc, bar, per_sm * sms, bn, bk, warps, stages), want32, nbytes)


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
