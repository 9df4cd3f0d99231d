"""The GGUF block kernels (kernels/cpu/quant_gemm.cpp, quant_simd.cpp) against plain torch:
gguf-py dequantizes the weight, the activations are the kernel's own int8 ones (checked bit
for bit against a torch version first), and the float64 matmul of the two is the answer.
Every instruction set this CPU runs is tested, the plain rows always, at ragged shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from ggml_blocks import random_blocks  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels.cpu import quant_isas  # noqa: E402
from ember.layers.linear import Linear, MergedLinear  # noqa: E402
from ember.layers.quant.gguf_blocks import KERNEL_TYPES, BlockTensor, GGUFBlocks  # noqa: E402
from ember.layers.quant.split import Dense, Split  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = [T(q) for q in KERNEL_TYPES]
# (m, n, k): ragged in every dimension; k = 96 and 160 are an odd number of 32-blocks
SHAPES = [(1, 37, 512), (3, 16, 256), (4, 64, 768), (5, 33, 512), (17, 48, 256), (2, 19, 96), (6, 5, 160)]


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels.ops()
    assert ops is not None, "CI's machine has a compiler: the kernels must build"
    yield ops
    ops.quant_isa("best")


@pytest.fixture(params=quant_isas())
def isa(request, ops):
    ops.quant_isa(request.param)
    yield request.param
    ops.quant_isa("best")


def torch_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quant.h's rule: d = max|x| / 127, q = round_half_even(x * (1 / d)), s = d * sum(q),
    h = d * the sums of q over each half."""
    b = x.float().view(x.shape[0], -1, 32)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv.unsqueeze(-1))
    halves = q.view(*q.shape[:-1], 2, 16).sum(-1)
    return q.to(torch.int8).view(x.shape), d, d * q.sum(-1), d.unsqueeze(-1) * halves


def reference(raw: np.ndarray, qtype: T, xq, xd) -> torch.Tensor:
    n = raw.shape[0]
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float64)).reshape(n, -1)
    x = (xq.double().view(xq.shape[0], -1, 32) * xd.double().unsqueeze(-1)).view(xq.shape)
    return x @ w.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_quantize_as_the_torch_rule(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 256, generator=g) * 3).to(dtype)
    x[2, :32] = 0  # a block of zeros: d = 0, q = 0
    x[3, 32:64] = torch.arange(32) - 15.5  # halves: ties round to even
    q, d, s, h = ops.quantize_rows(x)
    want = torch_quantize_rows(x)
    assert torch.equal(q, want[0]) and torch.equal(d, want[1]) and torch.equal(s, want[2])
    assert torch.equal(h, want[3])  # per 16 values (Q6_K's scales)
    assert torch.equal(q[2, :32], torch.zeros(32, dtype=torch.int8)) and d[2, 0] == 0
    assert q.abs().max() == 127
    # a strided view (q|k|v's q part) reads the same
    wide = torch.cat([x, x], dim=1)
    assert torch.equal(ops.quantize_rows(wide[:, :256])[0], q)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matmul_equals_dequantize_then_matmul(ops, isa, qtype, m, n, k):
    if k % gguf.GGML_QUANT_SIZES[qtype][0]:
        pytest.skip("a row holds whole blocks")
    raw = random_blocks(qtype, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    q = ops.quantize_rows(x)
    xq, xd = q[0], q[1]
    got = ops.quant_matmul(*q, ops.quant_repack(torch.from_numpy(raw), int(qtype)), int(qtype), n, None, torch.float32)
    want = reference(raw, qtype, xq, xd)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float rounding only: each output is a sum of k products of numbers exact in float32
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, (isa, err)


def test_the_dispatch_picks_the_best_this_cpu_has(ops):
    best = quant_isas()[-1]
    assert ops.quant_isa("best") == best
    assert ops.quant_isa("") == best
    if best != "avx512_vnni":
        with pytest.raises(RuntimeError, match="cannot run the avx512_vnni kernels"):
            ops.quant_isa("avx512_vnni")
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9'"):
        ops.quant_isa("sse9")
    assert ops.quant_isa("") == best


def test_bias_and_output_dtype(ops):
    tiles = ops.quant_repack(torch.from_numpy(random_blocks(T.Q4_0, 40, 64, seed=3)), int(T.Q4_0))
    assert tiles.numel() == 3 * 2 * (32 + 256)  # 40 rows: 3 tiles of 16, 2 sub-blocks each
    x = torch.randn(2, 64)
    q = ops.quantize_rows(x)
    bias = torch.randn(40)
    plain = ops.quant_matmul(*q, tiles, int(T.Q4_0), 40, None, torch.float32)
    assert torch.equal(ops.quant_matmul(*q, tiles, int(T.Q4_0), 40, bias, torch.float32), plain + bias)
    assert torch.equal(ops.quant_matmul(*q, tiles, int(T.Q4_0), 40, None, torch.bfloat16), plain.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="w must be the repacked tiles of 49 rows of 64 values"):
        ops.quant_matmul(*q, tiles, int(T.Q4_0), 49, None, torch.float32)
    with pytest.raises(RuntimeError, match="no kernel for GGML type 10"):
        ops.quant_matmul(*q, tiles, 10, 40, None, torch.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_come_back_as_the_file_s_values(ops, qtype):
    """An embedding lookup on the tiles gives gguf-py's dequantized rows, bit for bit."""
    k = 512
    raw = random_blocks(qtype, 37, k, seed=4)
    tiles = ops.quant_repack(torch.from_numpy(raw), int(qtype))
    want = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(37, k)
    ids = torch.tensor([0, 36, 17, 15, 16, 17])
    assert torch.equal(ops.quant_rows(tiles, int(qtype), 37, k, ids), want[ids])
    with pytest.raises(RuntimeError, match=r"row id 37 is not in \[0, 37\)"):
        ops.quant_rows(tiles, int(qtype), 37, k, torch.tensor([37]))


def _blocks(qtype: T, rows: int, k: int, seed: int) -> BlockTensor:
    return BlockTensor(int(qtype), (rows, k), torch.from_numpy(random_blocks(qtype, rows, k, seed)))


def test_merged_layer_stacks_shards_of_one_type_and_splits_mixed_ones():
    """q|k|v from a Q4_K_M file: one kernel call where the shards share a type; a Split (one
    activation quantization, a call a part) where v is Q6_K, or a dense F16 shard."""
    k = 256
    x = torch.randn(3, k)
    shards = [_blocks(T.Q4_K, 64, k, 1), _blocks(T.Q4_K, 32, k, 2), _blocks(T.Q6_K, 32, k, 3)]
    dense_v = torch.randn(32, k)
    want = torch.cat([x @ s.dequantize().T for s in shards], dim=1)
    for v, want_v in [(shards[2], None), (None, dense_v)]:
        layer = MergedLinear(k, [64, 32, 32])
        for i, s in enumerate(shards[:2]):
            layer.load_blocks(s, i)
        if v is not None:
            layer.load_blocks(v, 2)
        else:
            with torch.no_grad():
                layer.weight[96:].copy_(dense_v)
        layer.finish_loading()
        assert isinstance(layer.format, Split) and layer.weight.device.type == "meta"
        kinds = [type(p) for p in layer.format.parts]
        assert kinds == [GGUFBlocks, GGUFBlocks, GGUFBlocks if v is not None else Dense]
        got = layer(x)
        expect = want if want_v is None else torch.cat([want[:, :96], x @ dense_v.T], dim=1)
        assert (got - expect).abs().max() / expect.abs().max() < 0.02  # int8 activations
    same = MergedLinear(k, [64, 32])
    same.load_blocks(shards[0], 0)
    same.load_blocks(shards[1], 1)
    same.finish_loading()
    assert isinstance(same.format, GGUFBlocks) and (same.format.out_features, same.format.in_features) == (96, k)
    stacked = cpu_kernels.ops().quant_repack(torch.cat([shards[0].data, shards[1].data]), int(T.Q4_K))
    assert torch.equal(same.format.packed, stacked)
    plain = Linear(k, 64)
    with pytest.raises(ValueError, match=r"parameter rows \(64, 256\), checkpoint \(32, 256\)"):
        plain.load_blocks(shards[1], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", ["norm", "norm+residual", "silu", "gelu_tanh"])
def test_fused_prologue_equals_the_plain_op_then_the_matmul(ops, dtype, prologue):
    """quant_linear runs the op before the layer (layers/fused.py) on each row as it
    quantizes it: the same as that op in torch, then quantize_rows and quant_matmul."""
    from ember.layers.activation import gelu_tanh_and_mul, silu_and_mul
    from ember.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(5)
    k, n = 256, 40
    raw = torch.from_numpy(random_blocks(T.Q4_1, n, k, seed=9))
    gated = prologue in ("silu", "gelu_tanh")
    x = torch.randn(3, 2 * k if gated else k, generator=g).to(dtype)
    norm = RMSNorm(k, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    residual = torch.randn(3, k, generator=g).to(dtype) if prologue == "norm+residual" else None
    with cpu_kernels.disabled():
        if prologue == "silu":
            h = silu_and_mul(x)
        elif prologue == "gelu_tanh":
            h = gelu_tanh_and_mul(x)
        elif residual is None:
            h = norm(x)
        else:
            h, want_residual = norm(x, residual.clone())
    tiles = ops.quant_repack(raw, int(T.Q4_1))
    want = ops.quant_matmul(*ops.quantize_rows(h), tiles, int(T.Q4_1), n, None, dtype)
    kind = prologue.split("+")[0]
    got_residual = None if residual is None else residual.clone()
    got = ops.quant_linear(x, tiles, int(T.Q4_1), n, None, kind, norm.weight if kind == "norm" else None, 1e-5,
                           got_residual)
    assert got.dtype == dtype
    if residual is not None:
        assert torch.equal(got_residual, want_residual)  # one rounded add, as the plain norm
    # the prologue's values differ from torch's by float rounding at most, which can move an
    # activation to the next int8 step: a small fraction of one step's worth
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < (2e-3 if dtype == torch.float32 else 2e-2), err


def test_fused_prologue_refuses_what_it_cannot_take(ops):
    raw = ops.quant_repack(torch.from_numpy(random_blocks(T.Q4_0, 8, 64, seed=1)), int(T.Q4_0))
    with pytest.raises(RuntimeError, match="unknown prologue 'relu'"):
        ops.quant_linear(torch.randn(1, 64), raw, int(T.Q4_0), 8, None, "relu", None, 0.0, None)
    with pytest.raises(RuntimeError, match="the norm takes a contiguous weight"):
        ops.quant_linear(torch.randn(1, 64), raw, int(T.Q4_0), 8, None, "norm", torch.ones(32), 1e-5, None)
    with pytest.raises(RuntimeError, match="a gated activation takes"):
        ops.quant_linear(torch.randn(1, 127), raw, int(T.Q4_0), 8, None, "silu", None, 0.0, None)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("prologue", ["none", "norm", "silu"])
def test_a_row_gets_the_same_bits_in_calls_of_any_size(ops, isa, qtype, prologue):
    """Batch invariance: rows computed in calls of 1, 7, 16, 33 and 512 rows, at any offset in
    the batch (a tile of 4 rows, its tail of 1 to 3), are those of one call over all 512, bit
    for bit, with each prologue fused in; and so are the activations' int8 rows."""
    k, n = 512, 48
    g = torch.Generator().manual_seed(int(qtype))
    tiles = ops.quant_repack(torch.from_numpy(random_blocks(qtype, n, k, seed=int(qtype))), int(qtype))
    x = torch.randn(512, 2 * k if prologue == "silu" else k, generator=g)
    weight = torch.rand(k, generator=g) + 0.5 if prologue == "norm" else None
    run = lambda rows: ops.quant_linear(rows.contiguous(), tiles, int(qtype), n, None, prologue, weight, 1e-5,  # noqa: E731
                                        None)
    whole = run(x)
    for size in (1, 7, 16, 33):
        for start in (0, 5, 470):
            assert torch.equal(run(x[start:start + size]), whole[start:start + size]), (size, start)
    assert torch.equal(ops.quantize_rows(x[3:10, :k].contiguous())[0], ops.quantize_rows(x[:, :k].contiguous())[0][3:10])
