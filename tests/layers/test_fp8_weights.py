"""FP8 weights as layers hold them (layers/quant/fp8.py), on the CPU: what a checkpoint's
scale shapes mean, quantizing a dense weight per output row, the activations' reference
quantization, stacking the shards of a merged layer, and the CPU matmul (the dequantized
weight through F.linear: the reference every other path is held to)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.layers.linear import Linear, MergedLinear
from ember.layers.quant.fp8 import AMAX_FLOOR, FP8, FP8Tensor, FP8Weight, quantize_rows, quantize_weight, stack_fp8
from ember.layers.quant.split import Dense, Split


def _fp8(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (100 * torch.randn(n, k, generator=g)).clamp(-448, 448).to(FP8)


def test_a_scale_is_read_by_its_shape():
    w = _fp8(200, 300)
    per_tensor = FP8Tensor.from_checkpoint(w, torch.tensor(0.5, dtype=torch.bfloat16), None)
    assert per_tensor.scale.shape == (200,) and torch.all(per_tensor.scale == 0.5) and not per_tensor.blockwise
    assert FP8Tensor.from_checkpoint(w, torch.tensor([0.5]), None).scale.shape == (200,)
    rows = torch.rand(200, 1)
    assert torch.equal(FP8Tensor.from_checkpoint(w, rows, None).scale, rows.view(200))
    grid = torch.rand(2, 3)
    block = FP8Tensor.from_checkpoint(w, grid, (128, 128))
    assert block.blockwise and torch.equal(block.scale, grid)
    with pytest.raises(ValueError, match="names no weight block size"):
        FP8Tensor.from_checkpoint(w, grid, None)
    with pytest.raises(ValueError, match=r"blocks of \[64, 64\]"):
        FP8Tensor.from_checkpoint(w, torch.rand(4, 5), (64, 64))
    with pytest.raises(ValueError, match=r"\[2, 3\] \(per 128 x 128 block\); got \[3, 3\]"):
        FP8Tensor.from_checkpoint(w, torch.rand(3, 3), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        FP8Tensor(w.float(), torch.rand(200))


def test_dequantize_multiplies_each_block_by_its_scale():
    w = _fp8(200, 300)
    grid = torch.rand(2, 3)
    got = FP8Tensor(w, grid).dequantize()
    for i, j in [(0, 0), (1, 2), (199, 299), (127, 128), (128, 127)]:
        assert got[i, j] == w[i, j].float() * grid[i // 128, j // 128]
    assert FP8Tensor(w, grid).dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_quantize_weight_per_row_within_e4m3_rounding():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w[5] = 0
    t = quantize_weight(w)
    assert t.weight.dtype == FP8 and t.scale.shape == (64,) and not t.blockwise
    amax = w.abs().amax(1)
    assert torch.equal(t.scale[amax > 0], amax[amax > 0] / 448) and t.scale[5] == AMAX_FLOOR / 448
    assert torch.equal(t.weight.float().abs().amax(1)[amax > 0], torch.full((63,), 448.0))
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal spacing 2^-9 (times the scale)
    err = (t.dequantize() - w).abs()
    assert torch.all(err <= w.abs() * 2 ** -4 + t.scale[:, None] * 2 ** -10)


def test_quantize_rows_maps_each_row_and_group_maximum_to_448():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 300, generator=g).bfloat16()
    q, s = quantize_rows(x)
    assert s.shape == (3, 1) and torch.equal(s[:, 0], x.float().abs().amax(1) / 448)
    q, s = quantize_rows(x, 128)
    assert s.shape == (3, 3) and torch.equal(s[:, 2], x.float()[:, 256:].abs().amax(1) / 448)
    assert q.shape == (3, 300) and torch.equal(q[:, 256:].float().abs().amax(1), torch.full((3,), 448.0))
    per_column = s.repeat_interleave(128, 1)[:, :300]
    assert torch.all((q.float() * per_column - x.float()).abs() <= x.float().abs() * 2 ** -4 + per_column * 2 ** -10)


def test_shards_stack_where_their_scales_line_up():
    rows = [FP8Tensor(_fp8(n, 256, i), torch.rand(n)) for i, n in enumerate((256, 64, 64))]
    stacked = stack_fp8(rows)
    assert stacked.shape == (384, 256) and torch.equal(stacked.scale, torch.cat([r.scale for r in rows]))
    blocks = [FP8Tensor(_fp8(n, 256, i), torch.rand(-(-n // 128), 2)) for i, n in enumerate((256, 128, 100))]
    stacked = stack_fp8(blocks)
    assert stacked.blockwise and stacked.scale.shape == (4, 2)
    assert torch.equal(stacked.dequantize(), torch.cat([b.dequantize() for b in blocks]))
    unaligned = [FP8Tensor(_fp8(64, 256), torch.rand(1, 2)), FP8Tensor(_fp8(64, 256), torch.rand(1, 2))]
    assert stack_fp8(unaligned) is None  # the second shard's rows would start mid-block
    assert stack_fp8([rows[0], blocks[1]]) is None


def test_the_cpu_matmul_is_f_linear_on_the_dequantized_weight():
    t = FP8Tensor(_fp8(200, 300), torch.rand(2, 3) / 300)
    layer = FP8Weight(t)
    x = torch.randn(2, 5, 300)
    b = torch.randn(200)
    assert torch.equal(layer.apply(x, b), F.linear(x, t.dequantize(), b))
    xb = x.bfloat16()
    assert torch.equal(layer.apply(xb), F.linear(xb, t.dequantize(torch.bfloat16)))
    assert layer.nbytes == 200 * 300 + 6 * 4 and (layer.out_features, layer.in_features) == (200, 300)


def test_a_merged_layer_takes_fp8_shards_as_one_format_or_side_by_side():
    qkv = MergedLinear(256, [256, 128, 128], bias=True)
    parts = [quantize_weight(torch.randn(n, 256)) for n in (256, 128, 128)]
    for i, p in enumerate(parts):
        qkv.load_fp8(p, i)
    qkv.finish_loading()
    assert isinstance(qkv.format, FP8Weight) and qkv.weight.device.type == "meta"
    x = torch.randn(3, 256)
    torch.testing.assert_close(qkv(x), F.linear(x, torch.cat([p.dequantize() for p in parts]), qkv.bias))

    # block scales whose shards do not fill whole 128-row blocks, and a dense shard: side by side
    mixed = MergedLinear(256, [64, 64])
    mixed.weight.data.normal_()
    block = FP8Tensor(_fp8(64, 256), torch.rand(1, 2) / 256)
    mixed.load_fp8(block, 0)
    dense = mixed.weight.data[64:].clone()
    mixed.finish_loading()
    assert isinstance(mixed.format, Split)
    assert [type(p) for p in mixed.format.parts] == [FP8Weight, Dense]
    torch.testing.assert_close(mixed(x), F.linear(x, torch.cat([block.dequantize(), dense])))
    with pytest.raises(ValueError, match="parameter rows"):
        Linear(256, 64).load_fp8(block.__class__(_fp8(32, 256), torch.rand(32)), None)


def test_quantize_fp8_at_load_keeps_the_bias_and_frees_the_dense_weight():
    layer = Linear(96, 48, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    dense = layer.weight.data.clone()
    layer.quantize_fp8()
    assert isinstance(layer.format, FP8Weight) and layer.weight.device.type == "meta"
    x = torch.randn(4, 96)
    torch.testing.assert_close(layer(x), F.linear(x, quantize_weight(dense).dequantize(), layer.bias))
