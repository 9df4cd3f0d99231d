"""The GPU tests here run on lent GPUs (the device tool), where NVLink multicast must stay off:
other tenants could exhaust the host's multicast objects (the device README's KINDS.md). The
product leaves it to the user; these tests, and the worker processes they start, set it off
unless the environment says otherwise (benchmarks/scripts/h200.sh does the same)."""

import os

for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(key, value)
