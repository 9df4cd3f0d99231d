"""Probe for one request at Llama-8B (goal 4.0 ms a step, ember 4.6): does warming the next
weight in L2 while the small kernels run speed up the matmul after them?

A step's shape without its data: 32 layers, each q|k|v (cuBLAS) -> a 9 µs stand-in for
RoPE + attention -> o (ember's GEMV) -> 2 µs (norm) -> gate|up (cuBLAS) -> 1.6 µs (SiLU) ->
down (cuBLAS) -> 2 µs (next norm), distinct weights per layer so nothing stays in L2. The
stand-ins spin on one SM without touching memory, so this is the best case for prefetching;
the engine's own step was the real test (EMBER_L2_PREFETCH at 8e507ec: 218 -> 203-214 tok/s).
`python3 benchmarks/scripts/l2_prefetch_probe.py` (CUDA)."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ember.kernels.gemv import gemv
from step_chain import HIDDEN, INTER, LAYERS, Spinner, layer_weights

# The prefetch kernel, as the engine carried it for this experiment (commit 8e507ec, removed
# after it lost): a program per 1024 lines issues prefetch.global.L2 for `fraction` of a
# weight's 128-byte lines (the first `take` of every `group`) and exits.
LINE = 128  # bytes
HINTS = {"normal": 0, "last": 1}  # the lines' eviction priority in L2


@triton.jit
def _prefetch_kernel(w_ptr, n_lines, n_take, GROUP: tl.constexpr, TAKE: tl.constexpr,
                     LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    line = (j // TAKE) * GROUP + j % TAKE
    mask = (j < n_take) & (line < n_lines)
    ptrs = w_ptr + tl.where(mask, line, 0).to(tl.int64) * LINE_ELEMS
    # not pure: the compiler keeps the asm although its (dummy) result goes unused
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def split_fraction(fraction: float) -> tuple[int, int]:
    """(group, take): take the first `take` lines of every `group`, closest to `fraction`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the prefetched fraction must be in (0, 1], got {fraction}")
    if fraction >= 1 / 8:
        return 8, max(1, round(8 * fraction))
    return round(1 / fraction), 1


def prefetch_l2(weight: torch.Tensor, fraction: float, hint: str = "normal", block: int = 1024):
    """Issue L2 prefetches for `fraction` of a contiguous CUDA tensor's lines; nothing waits
    for the lines. Returns the launched kernel (its PTX for a test), None off CUDA."""
    group, take = split_fraction(fraction)
    if hint not in HINTS:
        raise ValueError(f"hint must be one of {sorted(HINTS)}, got {hint!r}")
    if not weight.is_cuda:
        return None
    if not weight.is_contiguous():
        raise ValueError(f"prefetch_l2 needs a contiguous tensor; got strides {weight.stride()}")
    n_lines = weight.numel() * weight.element_size() // LINE
    n_take = triton.cdiv(n_lines, group) * take
    if n_take == 0:
        return None
    return _prefetch_kernel[(triton.cdiv(n_take, block),)](
        weight, n_lines, n_take, GROUP=group, TAKE=take, LINE_ELEMS=LINE // weight.element_size(), BLOCK=block,
        EVICT_LAST=HINTS[hint], num_warps=4)


def main() -> None:
    from gemv_bench import time_us

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    print(f"L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MiB", flush=True)
    layers = layer_weights(dev=dev, dt=dt)
    nbytes = sum(w.numel() * 2 for ws in layers for w in ws.values())
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    spin = Spinner()

    def step(plan: dict[str, float], hint: str, spins: bool) -> torch.Tensor:
        x = x0
        for i, ws in enumerate(layers):
            def pre(site: str, w: torch.Tensor) -> None:
                if plan.get(site):
                    prefetch_l2(w, plan[site], hint)
            if spins:
                spin(2.0)
            qkv = F.linear(x, ws["qkv"])
            pre("o", ws["o"])
            if spins:
                spin(9.0)
            h = gemv(qkv[:, :HIDDEN], ws["o"])
            pre("gate_up", ws["gate_up"])
            if spins:
                spin(2.0)
            gu = F.linear(h, ws["gate_up"])
            pre("down", ws["down"])
            if spins:
                spin(1.6)
            x = F.linear(gu[:, :INTER], ws["down"])
            if i + 1 < LAYERS:
                pre("qkv", layers[i + 1]["qkv"])
        return x

    base_out = step({}, "normal", True).float()
    runs = [("no spins, no prefetch", {}, "normal", False), ("no prefetch", {}, "normal", True)]
    for hint in ("normal", "last"):
        for plan in ({"o": 1.0}, {"o": 0.5}, {"o": 1.0, "qkv": 0.25}, {"o": 1.0, "qkv": 0.25, "gate_up": 0.05,
                                                                       "down": 0.1},
                     {"o": 1.0, "qkv": 0.5, "gate_up": 0.125, "down": 0.25}):
            runs.append((",".join(f"{k}={v}" for k, v in plan.items()) + f" ({hint})", plan, hint, True))
    for name, plan, hint, spins in runs:
        us = time_us(lambda i: step(plan, hint, spins), copies=1, reps=1)
        same = torch.equal(step(plan, hint, spins).float(), base_out)
        print(f"{name:55s} {us:8.1f} us a step ({nbytes / us / 1e6:5.2f} TB/s of weights), same output {same}",
              flush=True)
    k = prefetch_l2(layers[0]["o"], 1.0)
    print("prefetch instructions in the PTX:", k.asm["ptx"].count("prefetch.global.L2"))


if __name__ == "__main__":
    main()
