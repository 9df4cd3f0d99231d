"""A decode step's small all-reduces in one kernel over the GPUs' mapped memory.

At the Llama-3.1-8B shape a decode step makes 64 all-reduces (after attention and after the
MLP, in each layer) of a few KiB each, and NCCL's has a latency of its own however small the
message (benchmarks/scripts/all_reduce_bench.py times both). torch's symmetric memory maps every rank's buffer into every rank's address space,
and its one-shot all-reduce is one kernel: each rank copies its input into its own buffer,
waits at a barrier, reads every rank's buffer over NVLink and sums, and waits at a second
barrier (so no rank overwrites its buffer while a peer still reads it). Messages above the
buffer (a prefill chunk's) go to NCCL, whose ring moves large ones at the links' bandwidth.

Peer loads only: it needs no NVLink multicast (the `multimem` operations), so it runs where
multicast is turned off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, as the
device scripts do on GPUs that are lent). torch's CUDA backend of symmetric memory is asked
for by name; its NVSHMEM backend is not needed for this.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

MAX_BYTES = 8 << 20  # a decode step of 512 sequences at hidden size 8192 in bfloat16


class PeerAllReduce:
    """Sums a tensor over the group's ranks through one symmetric buffer of `max_bytes`.
    A collective to build: every rank of `group` constructs it, in the same order."""

    def __init__(self, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device,
                 max_bytes: int = MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "set_backend") and symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` goes this way; a property of its shape, dtype and layout alone, so
        every rank decides alike for the same all-reduce."""
        n = x.numel()
        # the kernel moves 4, 8 or 16 bytes a load, with the same width on both sides
        return (x.dtype == self.dtype and 0 < n <= self.max_numel and x.is_contiguous()
                and x.storage_offset() == 0 and n * x.element_size() % 4 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (each thread reads its elements of x before it
        writes their sums back)."""
        flat = x.view(-1)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[: flat.numel()], flat, "sum",
                                                        self.group_name, flat)
        return x


def why_not_peer(group: dist.ProcessGroup) -> str | None:
    """Why this group cannot map its ranks' memory (None: it can). A collective: every rank
    gets the same answer. Ranks on other hosts, or GPUs without peer access, rule it out."""
    here = (socket.gethostname(), torch.cuda.current_device())
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, here, group=group)
    if len({host for host, _ in ranks}) > 1:
        return "the ranks span hosts"
    gpus = [gpu for _, gpu in ranks]
    if len(set(gpus)) < len(gpus):
        return "two ranks share a GPU"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return "this torch has no one-shot all-reduce"
    # every rank checks its own view; any refusal rules it out for all
    mine = torch.cuda.current_device()
    ok = all(torch.cuda.can_device_access_peer(mine, gpu) for gpu in gpus if gpu != mine)
    oks: list = [None] * len(ranks)
    dist.all_gather_object(oks, ok, group=group)
    return None if all(oks) else "the GPUs have no peer access"
