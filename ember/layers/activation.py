import torch
import torch.nn.functional as F

from ember.kernels import cpu as cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, where gate_up = [gate | up] along the last dim (one Triton
    kernel on CUDA, one C++ loop on the CPU)."""
    if gate_up.is_cuda:
        from ember.kernels.activation import silu_and_mul as fused

        return fused(gate_up)
    if (ops := cpu_kernels.for_tensor(gate_up)) is not None and gate_up.is_contiguous():
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu_tanh(gate) * up, where gate_up = [gate | up] along the last dim
    (one Triton kernel on CUDA)."""
    if gate_up.is_cuda:
        from ember.kernels.activation import gelu_tanh_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_PLAIN = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu}


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """An MLP's activation on its own (GPT-2's and Phi-2's tanh GELU, OPT's ReLU): gelu_tanh, gelu or relu."""
    return _PLAIN[name](x)
