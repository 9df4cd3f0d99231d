"""Launch-order helpers shared by the Triton matmul kernels."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped launch order: GROUP_M row tiles in turn take
    each column tile, so a column tile of the weight is read while it is still in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows
