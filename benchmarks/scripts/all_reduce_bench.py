"""One all-reduce's time on N GPUs, NCCL against the peer all-reduce
(ember/distributed/peer_all_reduce.py), bfloat16, from one decode token at hidden 4096 (8 KiB)
to the peer buffer's 8 MiB and past it. Each is timed as decode replays it: 32 all-reduces in
a row captured in one CUDA graph, the graph replayed 50 times after 5 warm-ups; rank 0 prints
microseconds per all-reduce. One process per GPU, NVLink multicast off.

    python3 benchmarks/scripts/all_reduce_bench.py --ranks 2 [--output-json FILE]

At --ranks 1 it checks its own plumbing (the sums are copies; the times mean nothing).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.getcwd())
from ember.distributed.parallel_state import free_port  # noqa: E402
from ember.distributed.peer_all_reduce import MAX_BYTES, PeerAllReduce  # noqa: E402

SIZES_KIB = [8, 32, 128, 512, 2048, 8192, 32768]
IN_GRAPH, REPLAYS = 32, 50
# NVLink multicast off: the device's GPUs are lent, and other tenants could exhaust its
# multicast objects (the device README's KINDS.md)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _time(reduce, x: torch.Tensor) -> float:
    """Microseconds per all-reduce, replayed from a graph of IN_GRAPH of them."""
    reduce(x)  # set-up outside the capture (NCCL's communicator, the kernel's first launch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(IN_GRAPH):
            reduce(x)
    for _ in range(5):
        graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * IN_GRAPH)


def _rank(rank: int, world: int, port: int, out: str | None) -> None:
    os.environ.update(NCCL_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    peer = PeerAllReduce(group, torch.bfloat16, torch.device("cuda", rank))
    rows = []
    for kib in SIZES_KIB:
        x = torch.full((kib * 512,), 0.5, dtype=torch.bfloat16, device="cuda")
        row = {"KiB": kib, "nccl_us": round(_time(lambda t: dist.all_reduce(t, group=group), x), 2)}
        if peer.fits(x):
            row["peer_us"] = round(_time(peer, x), 2)
        rows.append(row)
    if rank == 0:
        print(f"all-reduce over {world} GPU(s), bfloat16, in CUDA graphs (us per all-reduce; peer buffer "
              f"{MAX_BYTES >> 20} MiB)")
        for row in rows:
            ratio = f"{row['nccl_us'] / row['peer_us']:.2f}x" if "peer_us" in row else "-"
            print(f"  {row['KiB']:6d} KiB  NCCL {row['nccl_us']:8.2f}  peer {row.get('peer_us', '-'):>8}  "
                  f"NCCL/peer {ratio}")
        if out:
            with open(out, "w") as f:
                json.dump({"ranks": world, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    if torch.cuda.device_count() < ns.ranks:
        sys.exit(f"--ranks {ns.ranks} needs that many GPUs; {torch.cuda.device_count()} visible")
    mp.spawn(_rank, args=(ns.ranks, free_port(), ns.output_json), nprocs=ns.ranks)


if __name__ == "__main__":
    main()
