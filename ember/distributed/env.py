"""The environment the collectives start in (a leaf: parallel_state and peer_all_reduce both read it)."""

from __future__ import annotations

import os

# NVLink multicast (NVLS / symmetric memory) stays off: the machines that run ember lend
# GPUs whose multicast objects other tenants could exhaust (the device README's KINDS.md)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off() -> None:
    """NCCL_ENV's values, where the user has not set the variable."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
