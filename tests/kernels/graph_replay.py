"""A layer's kernels captured in a CUDA graph must follow what the static buffers hold at replay,
not what they held at capture: the check the `-m gpu` kernel tests share."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assert_graph_replays(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor],
                         new_inputs: Sequence[torch.Tensor], states: Sequence[torch.Tensor] = ()) -> None:
    """forward() reads the static `inputs` (and updates `states` in place, if it has any). It is
    captured in a CUDA graph, `new_inputs` are copied into the inputs, and the replay gives what
    an eager forward() gives on them from the same states, bit for bit: its output and the
    states it leaves."""
    forward()  # compiles what the capture needs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for x, new in zip(inputs, new_inputs, strict=True):
        x.copy_(new)
    before = [s.clone() for s in states]
    graph.replay()
    replayed, after = out.clone(), [s.clone() for s in states]
    for s, b in zip(states, before):
        s.copy_(b)
    torch.testing.assert_close(replayed, forward(), rtol=0, atol=0)
    for got, want in zip(after, states):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
