"""Bit-equality checks that hold on the GPU and not always on Triton's interpreter.

The interpreter runs `tl.dot` and the reductions through NumPy, whose OpenBLAS picks its
kernels and thread splits by the CPU's instruction set: a row can then get other last bits
from its tile's other rows (seen on an AVX2-only EPYC; AVX-512 machines gave equal bits).
That is NumPy's order of sums, not the kernel's, so there the check is closeness at about
one ulp of the dtype; on CUDA (the compiled kernel, `-m gpu`) it is the bits."""

import torch


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.is_cuda:
        assert torch.equal(got, want)
    else:
        rtol = 2 ** -7 if got.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=rtol)
