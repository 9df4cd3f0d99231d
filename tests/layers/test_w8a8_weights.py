"""W8A8 weights as layers hold them (layers/quant/w8a8.py) on the CPU: torch._int_mm gives the
plain-torch reference's bits (tests/w8a8_checkpoints.py: x quantized per token or by its static
scale, an exact integer sum, then the scales and the bias in float32); a checkpoint's scales read
per channel or per tensor; rows and columns narrowed for tensor-parallel ranks; merged shards
stacked where their activations quantize alike, else side by side."""

from __future__ import annotations

import pytest
import torch
from w8a8_checkpoints import quantize_weight, reference_linear

from ember.layers.linear import MergedLinear, RowParallelLinear
from ember.layers.quant.split import Split
from ember.layers.quant.w8a8 import W8A8Tensor, W8A8Weight, quantize_w8a8, stack_w8a8


def _tensor(n: int = 72, k: int = 100, static: float | None = None, seed: int = 0) -> W8A8Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    q, scale = quantize_weight(w)
    return W8A8Tensor.from_checkpoint(q, scale, None if static is None else torch.tensor([static]))


@pytest.mark.parametrize("static", [None, 0.03], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_path_is_the_reference_bit_for_bit(static, dtype):
    t = _tensor(static=static)
    layer = W8A8Weight(t)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(72, generator=g).to(dtype)
    for rows in (1, 5, 64):
        x = (2 * torch.randn(rows, 100, generator=g)).to(dtype)
        x[0, :3] = 0 if rows == 1 else torch.tensor([0.5, -1.5, 9.0]).to(dtype)
        got = layer.apply(x, bias)
        assert got.dtype == dtype
        assert torch.equal(got, reference_linear(x, t.weight, t.scale, static, bias).to(dtype))
    x = torch.zeros(2, 3, 100, dtype=dtype)  # rows of zeros, [B, T, K]
    assert torch.equal(layer.apply(x), torch.zeros(2, 3, 72, dtype=dtype))


def test_a_checkpoints_scales_per_channel_or_per_tensor():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for strategy in ("channel", "tensor"):
        q, scale = quantize_weight(w, strategy)  # bfloat16 [16, 1] or [1]
        t = W8A8Tensor.from_checkpoint(q, scale, None)
        assert t.scale.dtype == torch.float32 and torch.equal(t.scale, scale.float().reshape(-1).expand(16))
        assert torch.equal(t.dequantize(), q.float() * scale.float().reshape(-1, 1))
        # within a step: half of one from rounding, a whole one at the top (max |w| / 127.5 puts it at 127.5,
        # clamped to 127, and the bfloat16 scale can round below)
        torch.testing.assert_close(t.dequantize(), w, rtol=0, atol=scale.float().max().item())
    static = W8A8Tensor.from_checkpoint(q, scale, torch.tensor([0.25], dtype=torch.bfloat16))
    assert static.input_scale.dtype == torch.float32 and static.input_scale.tolist() == [0.25]


@pytest.mark.parametrize("weight, scale, input_scale, error", [
    (torch.zeros(4, 8), torch.ones(4, 1), None, r"weight must be int8 \[out, in\]; got torch.float32"),
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 2), None,
     r"weight_scale of an int8 weight \[4, 8\] is one number \(strategy tensor\) or \[4, 1\] \(strategy channel\); "
     r"got torch.float32 \[4, 2\]"),
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(1, 4), None, r"got torch.float32 \[1, 4\]"),
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), torch.ones(2), r"input_scale is one number"),
    (torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), torch.zeros(1), "input_scale must be positive"),
])
def test_tensors_that_do_not_fit_are_refused_by_name(weight, scale, input_scale, error):
    with pytest.raises(ValueError, match=error):
        W8A8Tensor.from_checkpoint(weight, scale, input_scale)


def test_narrow_rows_and_columns():
    t = _tensor(static=0.05)
    rows = t.narrow(0, 8, 24)
    assert torch.equal(rows.weight, t.weight[8:32]) and torch.equal(rows.scale, t.scale[8:32])
    cols = t.narrow(1, 40, 60)
    assert torch.equal(cols.weight, t.weight[:, 40:]) and torch.equal(cols.scale, t.scale)
    assert torch.equal(cols.input_scale, t.input_scale)


def test_a_row_parallel_rank_quantizes_its_own_columns():
    """Rank 1 of 2 holds columns [50, 100); x's tokens are quantized over those columns."""
    t = _tensor()
    layer = RowParallelLinear(100, 72)
    layer.in_start, layer.full_in_features = 50, 100
    layer.weight.data = torch.empty(72, 50)
    layer.reduces = True
    layer.load_w8a8(t, None)
    layer.reduces = False  # one process here: no all-reduce, the rank's partial sum
    layer.finish_loading()
    x = torch.randn(3, 50)
    assert torch.equal(layer(x), reference_linear(x, t.weight[:, 50:], t.scale))


def test_merged_shards_stack_where_their_activations_quantize_alike_else_sit_side_by_side():
    q, k = _tensor(64, seed=1, static=0.05), _tensor(32, seed=2, static=0.05)
    stacked = stack_w8a8([q, k])
    assert torch.equal(stacked.weight, torch.cat([q.weight, k.weight])) and torch.equal(stacked.input_scale,
                                                                                        q.input_scale)
    assert stack_w8a8([q, _tensor(32, static=0.06)]) is None  # two static scales
    assert stack_w8a8([q, _tensor(32)]) is None  # static beside dynamic
    assert stack_w8a8([_tensor(64), _tensor(32)]).input_scale is None
    a, b = _tensor(40, seed=3, static=0.05), _tensor(40, seed=4, static=0.02)
    layer = MergedLinear(100, [40, 40])
    layer.load_w8a8(a, 0)
    layer.load_w8a8(b, 1)
    layer.finish_loading()
    assert isinstance(layer.format, Split) and all(isinstance(p, W8A8Weight) for p in layer.format.parts)
    x = torch.randn(3, 100)
    want = torch.cat([reference_linear(x, a.weight, a.scale, 0.05), reference_linear(x, b.weight, b.scale, 0.02)], 1)
    assert torch.equal(layer(x), want)


def test_dummy_weights_round_to_their_row_scales():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(5))
    t = quantize_w8a8(w, 0.1)
    assert t.weight.abs().amax(1).tolist() == [127] * 24 and t.input_scale.tolist() == [pytest.approx(0.1)]
    torch.testing.assert_close(t.dequantize(), w, rtol=0, atol=t.scale.max().item() / 2)
