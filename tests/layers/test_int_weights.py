"""Integer weights as layers hold them (layers/quant/int_weight.py and the format readers
awq.py, gptq.py, compressed_tensors.py), on the CPU: each format packed here as its tool
writes it (tests/int_checkpoints.py) is read back by the format's published reference code
and by ember, to the same numbers exactly; the one layout's narrowing, stacking and
act-order sorting; and the CPU's mapping onto GGUF blocks (exact for Q4_0 and Q8_0; Q4_1's
float16 minimum measured)."""

from __future__ import annotations

import pytest
import torch
from int_checkpoints import (
    awq_reference,
    ct_reference,
    gptq_reference,
    pack_awq,
    pack_ct,
    pack_gptq,
    quantize,
)

from ember.layers.linear import MergedLinear, RowParallelLinear
from ember.layers.quant import int_weight
from ember.layers.quant.awq import awq_tensor
from ember.layers.quant.compressed_tensors import pack_quantized_tensor
from ember.layers.quant.gguf_blocks import GGUFBlocks
from ember.layers.quant.gptq import gptq_tensor
from ember.layers.quant.int_weight import (
    IntTensor,
    PermutedInput,
    cpu_blocks,
    int_format,
    pack_words,
    quantize_int,
    stack_int,
    unpack_words,
)
from ember.layers.quant.split import Dense, Split


def _weight(n: int = 72, k: int = 256, seed: int = 0) -> torch.Tensor:
    return 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_awq_packing_reads_back_through_autoawq_and_ember(group):
    qz = quantize(_weight(), 4, group, symmetric=False)
    p = pack_awq(qz)
    assert p["qweight"].shape == (256, 9) and p["qzeros"].shape == (256 // (256 if group == -1 else group), 9)
    want = qz.dequantized()
    assert torch.equal(awq_reference(p["qweight"], p["qzeros"], p["scales"], group), want)
    t = awq_tensor(p["qweight"], p["qzeros"], p["scales"], group)
    assert torch.equal(t.dequantize(), want) and torch.equal(t.values(), qz.q)
    assert t.g_idx is None and t.zeros is not None and t.group_size == (256 if group == -1 else group)


GPTQ = [(bits, sym, act, v1, group) for bits in (4, 8) for sym in (True, False) for act in (False, True)
        for v1 in (True, False) for group in (32, 64, 128, -1) if not (act and group == -1)]


@pytest.mark.parametrize("bits,sym,act,v1,group", GPTQ)
def test_gptq_packing_reads_back_through_gptq_and_ember(bits, sym, act, v1, group):
    qz = quantize(_weight(), bits, group, sym, act)
    p = pack_gptq(qz, v1)
    want = qz.dequantized()
    assert torch.equal(gptq_reference(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits, v1), want)
    t = gptq_tensor(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits, group, zeros_minus_one=v1)
    assert torch.equal(t.dequantize(), want)
    assert (t.zeros is None) == sym  # a symmetric scheme's zeros (all 2^(bits - 1)) are dropped
    assert (t.g_idx is None) == (not act)  # so is a g_idx that is k // group_size


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,act,sym", [(32, False, True), (128, False, True), (-1, False, True), (64, True, True),
                                           (128, False, False), (-1, False, False)])
def test_pack_quantized_reads_back_through_compressed_tensors_and_ember(bits, group, act, sym):
    k = 200 if group == -1 else 256  # per channel: a row of 200 values pads its last word
    qz = quantize(_weight(k=k), bits, group, sym, act, torch.bfloat16)
    p = pack_ct(qz)
    g_idx, zeros = p.get("weight_g_idx"), p.get("weight_zero_point")
    assert (zeros is None) == sym
    want = qz.dequantized()
    assert torch.equal(ct_reference(p["weight_packed"], p["weight_scale"], p["weight_shape"], bits, g_idx, group,
                                    zeros), want)
    t = pack_quantized_tensor(p["weight_packed"], p["weight_scale"], p["weight_shape"], g_idx, bits,
                              None if group == -1 else group, zeros)
    assert torch.equal(t.dequantize(), want) and t.scales.dtype == torch.bfloat16
    assert t.qweight is p["weight_packed"]  # the layout is theirs: nothing repacked


def test_a_gptq_v1_zero_the_format_cannot_hold_is_refused():
    qz = quantize(_weight(), 4, 32, symmetric=False)
    p = pack_gptq(qz, v1=False)
    p["qzeros"][0, 0] |= 0xF  # stored 15: v1 reads 16
    with pytest.raises(ValueError, match="stored as 15 would be 16"):
        gptq_tensor(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 4, 32, zeros_minus_one=True)


def test_shapes_that_do_not_fit_are_refused_by_name():
    qz = quantize(_weight(), 4, 32, symmetric=False)
    p = pack_awq(qz)
    with pytest.raises(ValueError, match=r"qzeros int32 \[4, 9\] and scales \[4, 72\]"):
        awq_tensor(p["qweight"], p["qzeros"], p["scales"], 64)
    with pytest.raises(ValueError, match="groups of 48 do not divide"):
        awq_tensor(p["qweight"], p["qzeros"], p["scales"], 48)
    g = pack_gptq(qz, v1=False)
    with pytest.raises(ValueError, match="a 4-bit GPTQ weight"):
        gptq_tensor(g["qweight"], g["qzeros"][:, :4], g["scales"], g["g_idx"], 4, 32, False)
    c = pack_ct(quantize(_weight(), 4, 32, True))
    with pytest.raises(ValueError, match=r"pack-quantized weight \[72, 256\] of 4 bits in groups of 64"):
        pack_quantized_tensor(c["weight_packed"], c["weight_scale"], c["weight_shape"], None, 4, 64)
    with pytest.raises(ValueError, match="3-bit integer weights are not supported"):
        IntTensor(torch.zeros(4, 3, dtype=torch.int32), torch.ones(4, 1), None, None, 3, 32, 32)


def test_words_pack_and_unpack_little_endian():
    values = torch.arange(16, dtype=torch.uint8).repeat(3, 1)
    words = pack_words(values, 4)
    assert words.tolist() == [[0x76543210, -0x01234568]] * 3  # 0xFEDCBA98 as a signed int32
    assert torch.equal(unpack_words(words, 4), values)
    assert pack_words(torch.tensor([[1, 2, 255]], dtype=torch.uint8), 8).tolist() == [[0x00FF0201]]


def _int_tensor(bits=4, group=32, zeros=True, act=False, n=72, k=256, seed=0) -> IntTensor:
    qz = quantize(_weight(n, k, seed), bits, group, not zeros, act, seed=seed)
    return IntTensor.from_values(qz.q, qz.scales, qz.zeros if zeros else None, qz.g_idx if act else None, bits,
                                 k if group == -1 else group)


def test_narrow_rows_and_whole_groups_of_columns():
    t = _int_tensor(group=64)
    full = t.dequantize()
    assert torch.equal(t.narrow(0, 8, 24).dequantize(), full[8:32])
    assert torch.equal(t.narrow(1, 128, 128).dequantize(), full[:, 128:])
    with pytest.raises(ValueError, match=r"columns \[32, 160\) of a weight quantized in groups of 64 columns: a "
                                         r"group spans two tensor-parallel ranks \(group 0\)"):
        t.narrow(1, 32, 128)
    with pytest.raises(ValueError, match="cut its int32 words of 8 values"):
        t.narrow(1, 4, 64)
    per_row = _int_tensor(group=-1)  # one group a row: any whole words
    assert torch.equal(per_row.narrow(1, 40, 96).dequantize(), per_row.dequantize()[:, 40:136])
    act = _int_tensor(act=True)  # act-order: every column keeps its group, every group's scales stay
    narrowed = act.narrow(1, 8, 120)
    assert narrowed.scales.shape == act.scales.shape and torch.equal(narrowed.dequantize(), act.dequantize()[:, 8:128])


def test_row_parallel_layer_refuses_a_group_that_spans_its_shard():
    t = _int_tensor(group=128, k=384)
    layer = RowParallelLinear(384, 72)
    layer.reduces, layer.in_start, layer.full_in_features = True, 192, 384  # rank 1 of 2: columns [192, 384)
    layer.weight.data = torch.empty(72, 192)
    with pytest.raises(ValueError, match=r"columns \[192, 384\) .* groups of 128 columns: a group spans two "
                                         r"tensor-parallel ranks \(group 1\)"):
        layer.load_int(t, None)


def test_merged_shards_stack_where_their_schemes_agree_else_sit_side_by_side():
    q, k = _int_tensor(n=64, seed=1), _int_tensor(n=32, seed=2)
    stacked = stack_int([q, k])
    assert stacked.shape == (96, 256) and torch.equal(stacked.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    assert stack_int([q, _int_tensor(n=32, zeros=False)]) is None  # zero points in one part only
    a, b = _int_tensor(act=True, seed=1), _int_tensor(act=True, seed=2)  # two column orders
    assert stack_int([a, b]) is None
    layer = MergedLinear(256, [72, 72])
    layer.load_int(a, 0)
    layer.load_int(b, 1)
    layer.finish_loading()
    assert isinstance(layer.format, Split) and all(isinstance(p, PermutedInput) for p in layer.format.parts)
    x = torch.randn(3, 256)
    want = x @ torch.cat([a.dequantize(), b.dequantize()]).t()
    torch.testing.assert_close(layer(x), want, **_int8_activations(want))


def test_act_order_sorts_into_plain_groups_and_permutes_the_input():
    t = _int_tensor(act=True)
    sorted_, order = t.sorted_by_group()
    assert sorted_.g_idx is None and torch.equal(sorted_.dequantize(), t.dequantize()[:, order])
    x = torch.randn(2, 256)
    torch.testing.assert_close(x[:, order] @ sorted_.dequantize().t(), x @ t.dequantize().t(), rtol=1e-5, atol=1e-5)
    uneven = IntTensor(t.qweight, t.scales, t.zeros, torch.zeros(256, dtype=torch.int32), 4, 32, 256)
    assert uneven.sorted_by_group() is None  # every column in group 0: no plain grouping
    assert _int_tensor().sorted_by_group() is None


def _int8_activations(want: torch.Tensor) -> dict[str, float]:
    """The block kernels quantize x to int8 per 32 values (llama.cpp's arithmetic): measured
    under 1 % of the largest output here."""
    return dict(rtol=0, atol=0.01 * want.abs().max().item())


def _block_values(t: IntTensor) -> torch.Tensor:
    blocks = cpu_blocks(t)
    assert not isinstance(blocks, str), blocks
    return blocks.dequantize()


@pytest.mark.parametrize("bits,zeros,group,name", [(4, False, 32, "Q4_0"), (4, False, 128, "Q4_0"),
                                                   (8, False, 64, "Q8_0"), (8, False, -1, "Q8_0"),
                                                   (4, True, 64, "Q4_1"), (4, True, -1, "Q4_1")])
def test_cpu_blocks_hold_the_weight(bits, zeros, group, name):
    """Q4_0 and Q8_0 exactly; Q4_1's minimum m = -z * s rounds to float16: measured at most
    0.4 % of a scale step here (the bound is half an ulp of z * s <= 15 s: 0.73 %)."""
    t = _int_tensor(bits, group, zeros)
    assert cpu_blocks(t).type_name == name
    got, want = _block_values(t), t.dequantize()
    if not zeros:
        assert torch.equal(got, want)
        return
    step = t.scales.float()[:, t.column_groups()]
    assert ((got - want).abs() / step).max() <= 0.004
    assert ((got - want).abs() / step).max() <= 15 * 2 ** -11


def test_cpu_blocks_name_what_they_cannot_hold():
    assert cpu_blocks(_int_tensor(8, 32, zeros=True)) == \
        "8-bit weights with zero points (no GGUF block type holds q - z exactly)"
    assert cpu_blocks(_int_tensor(4, 48, k=240)) == "groups of 48 columns over 240 (GGUF blocks hold 32)"
    assert cpu_blocks(_int_tensor(act=True)) == "act-order groups of uneven sizes (g_idx)"
    t = _int_tensor(zeros=False)
    fp32 = IntTensor(t.qweight, t.scales.float() * (1 + 2 ** -20), None, None, 4, 32, 256)
    assert cpu_blocks(fp32) == "torch.float32 scales that are not float16 values"


def test_cpu_format_is_blocks_permuted_blocks_or_dequantized(caplog, monkeypatch):
    monkeypatch.setattr(int_weight, "_logged", set())  # each reason is logged once a process: not yet here
    x = torch.randn(5, 256)
    for t, kind in [(_int_tensor(), GGUFBlocks), (_int_tensor(act=True), PermutedInput),
                    (_int_tensor(8, 32, zeros=True), Dense)]:
        fmt = int_format(t, torch.float32)
        assert isinstance(fmt, kind)
        want = x @ t.dequantize().t()
        tol = _int8_activations(want) if kind is not Dense else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fmt.apply(x), want, **tol)
    assert "8-bit integer weights dequantized to float32 at load on the CPU: 8-bit weights with zero points" \
        in caplog.text


def test_round_to_nearest_quantizes_within_half_a_step():
    w = _weight(64, 200)
    w[3] = 0  # a row of zeros: scale 1, values at the zero point
    assert torch.equal(quantize_int(w, 4, 32, False).dequantize()[3], torch.zeros(200))
    for bits, group, symmetric in [(4, 32, True), (4, 64, False), (8, -1, True)]:
        t = quantize_int(w, bits, group, symmetric)
        assert (t.zeros is None) == symmetric and t.bits == bits
        step = t.scales.float()[:, t.column_groups()]
        # half a step, and the float16 rounding of the scale (2^-11) over the <= 2^(bits-1) steps to the range's end
        assert ((t.dequantize() - w).abs() / step).max() <= 0.5 + 2 ** (bits - 1) * 2 ** -11
