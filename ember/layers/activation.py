import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where gate_up = [gate | up] along the last dim (one Triton
    kernel on CUDA)."""
    if gate_up.is_cuda:
        from ember.kernels.activation import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
