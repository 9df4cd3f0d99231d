"""The tensor-parallel group of this process, and the collectives the layers call.

One process per rank; `init_tensor_parallel` joins them over torch.distributed (gloo on
CPUs, NCCL on GPUs: the caller picks the process's GPU first, torch.cuda.set_device).
Until then, and after `destroy`, this process is rank 0 of 1 and every collective returns
its input: a model built without tensor parallelism runs as it always did.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None
_rank = 0
_size = 1
STORE_SCHEME = "store://"
_peer = None  # PeerAllReduce: the small all-reduces, where the ranks' GPUs map each other's memory


def init_tensor_parallel(rank: int, world_size: int, backend: str = "gloo", init_method: str = "env://",
                         timeout_s: float = 600.0) -> None:
    """Join the group of `world_size` ranks as `rank`. init_method: "store://host:port" (a store
    that `host_rendezvous` keeps), "tcp://host:port", "file:///path" or "env://" (MASTER_ADDR /
    MASTER_PORT)."""
    global _group, _rank, _size
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if _group is not None or dist.is_initialized():
        raise ValueError("tensor parallelism is initialized already in this process: call destroy() first")
    timeout = timedelta(seconds=timeout_s)
    if init_method.startswith(STORE_SCHEME):
        host, port = init_method[len(STORE_SCHEME):].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    _group, _rank, _size = dist.group.WORLD, rank, world_size


def host_rendezvous(host: str = "127.0.0.1") -> tuple[dist.TCPStore, str]:
    """A store for the ranks this process starts to meet at, and its address for
    `init_tensor_parallel` ("store://host:port"). The store binds a port the OS picks as it
    listens: a port found free and bound later by rank 0 can be taken in between (another
    engine's group did, failing a start with EADDRINUSE). Keep the store while the group lives:
    NCCL meets through it again when a communicator starts."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, f"{STORE_SCHEME}{host}:{store.port}"


def destroy() -> None:
    """Leave the group; this process is rank 0 of 1 again."""
    global _group, _rank, _size, _peer
    _peer = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _group, _rank, _size = None, 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    """Ranks in the group; 1 when tensor parallelism is not initialized."""
    return _size


def tp_group() -> dist.ProcessGroup | None:
    return _group


def enable_peer_all_reduce(dtype: torch.dtype) -> str | None:
    """Send the group's all-reduces of `dtype` that fit a decode step through the GPUs'
    mapped memory (peer_all_reduce.py) rather than NCCL. A collective. Returns why it stays
    with NCCL alone (ranks on several hosts, no peer access, not an NCCL group), or None."""
    global _peer
    from ember.distributed.peer_all_reduce import PeerAllReduce, why_not_peer

    if _size == 1 or dist.get_backend(_group) != "nccl":
        return "not a group of GPUs"
    if (reason := why_not_peer(_group)) is not None:
        return reason
    try:
        _peer = PeerAllReduce(_group, dtype, torch.device("cuda", torch.cuda.current_device()))
    except Exception as e:
        raise RuntimeError(f"rank {_rank}: the peer all-reduce's buffer failed ({e}); "
                           "--disable-custom-all-reduce leaves every all-reduce to NCCL") from e
    return None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in place; x itself at size 1."""
    if _size > 1:
        if _peer is not None and _peer.fits(x):
            return _peer(x)
        dist.all_reduce(x, group=_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order, on every rank."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x, group=_group)
    return torch.cat(parts, dim=-1)


def gather_last_dim(x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
    """The ranks' x side by side along the last dimension on rank `dst`; None on the others."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size)] if _rank == dst else None
    dist.gather(x, parts, dst=dst, group=_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def min_over_ranks(value: int) -> int:
    """The smallest of the ranks' `value` (the KV pool every rank can hold), on every rank."""
    if _size == 1:
        return value
    # NCCL reduces device tensors only
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend(_group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group)
    return int(t.item())


def gather_to_first(obj: object) -> list | None:
    """Every rank's `obj` (picklable), in rank order, on rank 0; None on the others."""
    if _size == 1:
        return [obj]
    out = [None] * _size if _rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=_group)  # NCCL: through the current device, as set
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a group's init address or a local server)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
