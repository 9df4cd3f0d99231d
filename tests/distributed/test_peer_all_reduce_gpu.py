"""The peer all-reduce (distributed/peer_all_reduce.py) on GPUs (`-m gpu`).

- One rank over NCCL (any CUDA machine): the one-shot kernel's copy into the buffer and read
  back give the input exactly, from 6 elements to the buffer's whole 8 MiB, eagerly and
  replayed from a CUDA graph; what it cannot take is refused (left to NCCL). Two ranks cannot
  share one GPU here: torch's symmetric memory refuses overlapping devices.
- Two GPUs (nvidia-h200-x2): `enable_peer_all_reduce` takes the peer path, and the layers'
  `all_reduce` gives NCCL's sums bit for bit (two addends: one rounding either way), eagerly
  and in a graph; a message above the buffer goes to NCCL, inside the same graph (NCCL's
  all-reduce captured: what decode graphs hold with --disable-custom-all-reduce).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import run_task  # pytest puts this folder on sys.path

from ember.distributed import parallel_state
from ember.distributed.peer_all_reduce import MAX_BYTES, PeerAllReduce

pytestmark = [pytest.mark.gpu]

BF16 = torch.bfloat16
MAX_NUMEL = MAX_BYTES // 2
# a 6-element tail (12 bytes: the kernel's 4-byte loads), one token at hidden 4096, 3 at 8192,
# 512 tokens at 4096 (a decode step of 512 at Llama-8B shape), the whole buffer
SIZES = [6, 4096, 3 * 8192, 512 * 4096, MAX_NUMEL]
GRAPH_NUMEL = 64 * 4096


def _values(n: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(BF16)


def _expected(n: int, seed: int, world: int = 2) -> torch.Tensor:
    total = sum(_values(n, r, seed).float() for r in range(world))
    return total.to(BF16)


def _needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s); {torch.cuda.device_count()} visible")


def _one_rank() -> dict:
    peer = PeerAllReduce(parallel_state.tp_group(), BF16, torch.device("cuda", 0))
    out = {}
    for n in SIZES:
        x = _values(n, 0, 0).cuda()
        assert peer.fits(x)
        out[n] = peer(x).cpu()
    static = torch.zeros(GRAPH_NUMEL, dtype=BF16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peer(static)
    for seed in (1, 2):
        static.copy_(_values(GRAPH_NUMEL, 0, seed))
        graph.replay()
        out[f"graph{seed}"] = static.cpu()
    cuda = dict(device="cuda")
    out["refused"] = [peer.fits(t) for t in (
        torch.ones(64, dtype=torch.float32, **cuda),  # not the buffer's dtype
        torch.ones(MAX_NUMEL + 2, dtype=BF16, **cuda),  # above the buffer
        torch.ones(66, dtype=BF16, **cuda)[2:],  # a view off its storage's start
        torch.ones(3, dtype=BF16, **cuda),  # 6 bytes: no 4-byte load fits
        torch.ones(8, 8, dtype=BF16, **cuda).t(),  # not contiguous
    )]
    return out


def test_one_rank_reads_back_its_input_exactly_eagerly_and_in_a_graph(tmp_path):
    _needs_gpus(1)
    (got,) = run_task(1, tmp_path, _one_rank, (), backend="nccl")
    for n in SIZES:
        assert torch.equal(got[n], _values(n, 0, 0)), n
    for seed in (1, 2):
        assert torch.equal(got[f"graph{seed}"], _values(GRAPH_NUMEL, 0, seed)), seed
    assert got["refused"] == [False] * 5


def _peer_against_nccl() -> dict:
    rank = parallel_state.tp_rank()
    out: dict = {"why": parallel_state.enable_peer_all_reduce(BF16)}
    for n in [*SIZES, MAX_NUMEL + 8]:
        x = _values(n, rank, 0).cuda()
        nccl = x.clone()
        dist.all_reduce(nccl)
        out[n] = (parallel_state.all_reduce(x).cpu(), nccl.cpu())
    small = torch.zeros(GRAPH_NUMEL, dtype=BF16, device="cuda")
    large = torch.zeros(MAX_NUMEL + 8, dtype=BF16, device="cuda")  # NCCL's, in the same graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parallel_state.all_reduce(small)
        parallel_state.all_reduce(large)
    for seed in (1, 2):
        small.copy_(_values(GRAPH_NUMEL, rank, seed))
        large.copy_(_values(MAX_NUMEL + 8, rank, seed))
        graph.replay()
        out[f"graph{seed}"] = (small.cpu(), large.cpu())
    return out


def test_two_gpus_take_the_peer_path_and_sum_as_nccl_does(tmp_path):
    _needs_gpus(2)
    ranks = run_task(2, tmp_path, _peer_against_nccl, (), backend="nccl")
    for got in ranks:
        assert got["why"] is None
        for n in [*SIZES, MAX_NUMEL + 8]:
            peer, nccl = got[n]
            assert torch.equal(peer, nccl) and torch.equal(peer, _expected(n, 0)), n
        for seed in (1, 2):
            small, large = got[f"graph{seed}"]
            assert torch.equal(small, _expected(GRAPH_NUMEL, seed))
            assert torch.equal(large, _expected(MAX_NUMEL + 8, seed))
