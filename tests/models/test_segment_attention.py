"""The vision towers' attention within segments of rows (models/qwen2_vl.py: Qwen2.5-VL's windows
and frames, Qwen3-VL's frames, Pixtral's images): the segments' two forms built from their runs,
and the attention against a plain loop over the segments, on the CPU (SDPA a length group) and on
CUDA (`-m gpu`: one varlen flash-attention call in half precision, the groups' path in float32)."""

from __future__ import annotations

import pytest
import torch

from ember.models.qwen2_vl import segment_attention, segments_of

RUNS = [(0, 64), (64, 128), (128, 176), (176, 240), (240, 256), (256, 304)]  # lengths 64, 64, 48, 64, 16, 48


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Each run's rows attending to each other alone, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for start, end in RUNS:
        qs, ks, vs = (t[start:end].double().transpose(0, 1) for t in (q, k, v))  # [heads, rows, dim]
        weights = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (weights @ vs).transpose(0, 1)
    return out


def qkv(dtype: torch.dtype, device: str, dim: int = 80) -> tuple[torch.Tensor, ...]:
    """q, k, v as the towers pass them: views of one [N, 3, heads, dim] projection (v's rows strided)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(RUNS[-1][1], 3, 4, dim, generator=g).to(device, dtype).unbind(1)


def test_segments_hold_their_bounds_and_their_rows_by_length():
    s = segments_of(RUNS, torch.device("cpu"))
    assert s.bounds.dtype == torch.int32 and s.bounds.tolist() == [0, 64, 128, 176, 240, 256, 304]
    assert s.longest == 64
    assert [(count, length) for count, length, _ in s.groups] == [(3, 64), (2, 48), (1, 16)]
    assert s.groups[1][2].tolist() == list(range(128, 176)) + list(range(256, 304))


def test_attention_stays_within_each_segment_on_the_cpu():
    q, k, v = qkv(torch.float32, "cpu")
    out = segment_attention(q, k, v, segments_of(RUNS, torch.device("cpu")), 80 ** -0.5)
    torch.testing.assert_close(out.double(), reference(q, k, v, 80 ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [64, 72, 80])  # Pixtral's, Qwen3-VL's, Qwen2.5-VL's heads
def test_attention_stays_within_each_segment_on_cuda(dtype, dim):
    q, k, v = qkv(dtype, "cuda", dim)
    scale = dim ** -0.5
    out = segment_attention(q, k, v, segments_of(RUNS, torch.device("cuda")), scale)
    want = reference(q.cpu(), k.cpu(), v.cpu(), scale)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
