"""The Llama-3.1-8B decode step's matmul chain, shared by the one-request probes
(pdl_probe, pdl_chain_probe, l2_prefetch_probe, l2_warm_probe, persistent_chain_probe):
its shapes, a layer's weights, and a one-program kernel that spins for as long as one of
the step's small kernels takes (the probes' stand-in for RoPE, attention, norms, SiLU)."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 14336, 32
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def layer_weights(layers: int = LAYERS, dev: str = "cuda", dt: torch.dtype = torch.bfloat16) -> list[dict]:
    """Distinct random weights per layer (so nothing stays in L2), {name: [N, K]} in chain order."""
    return [{name: torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for name, (n, k) in SHAPES.items()}
            for _ in range(layers)]


@triton.jit
def _spin_kernel(cell_ptr, iters, PDL: tl.constexpr = False):
    if PDL:  # launched with PDL: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    x = tl.load(cell_ptr)
    for _ in range(iters):
        x = x * 0.999 + 0.001
    tl.store(cell_ptr, x)


class Spinner:
    """spin(us): one program busy for about `us` µs, touching no memory but one float."""

    def __init__(self) -> None:
        from gemv_bench import time_us

        self.cell = torch.ones(1, device="cuda")
        self.us_per_iter = time_us(lambda i: _spin_kernel[(1,)](self.cell, 20000), copies=1, reps=5) / 20000

    def __call__(self, us: float, pdl: bool = False) -> None:
        _spin_kernel[(1,)](self.cell, max(1, round(us / self.us_per_iter)), PDL=pdl, launch_pdl=pdl)
