"""The FP8 kernels (kernels/fp8.py, the fp8-weight GEMV in kernels/gemv.py) and FP8Weight's
choice of them (layers/quant/fp8.py) against plain torch: the activations' quantization
exactly (the kernel's division and rounding are IEEE's, as torch's), the matmuls against a
float32 matmul of the dequantized operands. CPU: Triton's interpreter (tests/kernels/
conftest.py converts fp8 through torch, as the GPU rounds); `-m gpu`: CUDA, with
torch._scaled_mm on cuBLASLt, and the layer captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels.fp8 import fp8_matmul, matmul_config, quantize_groups  # noqa: E402
from ember.kernels.gemv import gemv  # noqa: E402
from ember.layers.activation import silu_and_mul  # noqa: E402
from ember.layers.kernel_paths import gemv_on_cpu  # noqa: E402
from ember.layers.norm import RMSNorm  # noqa: E402
from ember.layers.quant.fp8 import AMAX_FLOOR, FP8, FP8Tensor, FP8Weight, quantize_rows, quantize_weight  # noqa: E402

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(autouse=True)
def plain_torch_reference():
    with cpu_kernels.disabled():
        yield


def _weights(n: int, k: int, blockwise: bool, seed: int = 0) -> FP8Tensor:
    """Random fp8 values with per-row scales, or per-block scales of different sizes."""
    g = torch.Generator().manual_seed(seed)
    if not blockwise:
        return quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5)
    values = (64 * torch.randn(n, k, generator=g)).clamp(-448, 448).to(FP8)
    scales = (0.5 + torch.rand(-(-n // 128), -(-k // 128), generator=g)) / (64 * k ** 0.5)
    return FP8Tensor(values, scales)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_is_the_reference_exactly(device, dtype, group):
    g = torch.Generator().manual_seed(1)
    big = (3 * torch.randn(6, 400, generator=g)).to(dtype)
    big[2] = 0  # an all-zero row: scale AMAX_FLOOR / 448, values 0
    big[4, :7] = 1e4  # a row whose largest value dwarfs the rest
    x = big[:, 30:330]  # a strided view; K = 300: a last group of 44 columns
    q, scales = quantize_groups(x.to(device), group, AMAX_FLOOR)
    want_q, want_s = quantize_rows(x, group)
    assert scales.shape == (6, 1 if group is None else 3) and q.dtype == FP8
    assert torch.equal(_bits(q.cpu()), _bits(want_q)) and torch.equal(scales.cpu(), want_s)
    assert torch.all(scales[2] == AMAX_FLOOR / 448)
    # every row's (group's) largest magnitude maps to 448
    assert q.cpu()[0].float().abs().max() == 448


def _fp32_tol(device: str) -> dict[str, float]:
    """float32 output of fp8 dots: the interpreter sums exactly in float32; Hopper's fp8 tensor
    cores sum each 128-deep tile with fewer mantissa bits (DeepSeek-V3's report: ~14)."""
    return dict(atol=1e-4, rtol=1e-4) if device == "cpu" else dict(atol=2e-3, rtol=2e-3)


def _matmul_reference(q, q_scales, w: FP8Tensor, bias):
    """The float32 matmul of the dequantized activations and weights."""
    x = q.float() * (q_scales if q_scales.shape[1] == 1 else q_scales.repeat_interleave(128, 1)[:, :q.shape[1]])
    return F.linear(x, w.dequantize(), None if bias is None else bias.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blockwise", [False, True], ids=["per-row", "block"])
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_fp8_matmul_matches_the_dequantized_float32_matmul(device, blockwise, rows):
    n, k = 200, 300  # partial tiles and scale blocks in both dims
    w = _weights(n, k, blockwise)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    q, q_scales = quantize_rows(x, 128 if blockwise else None)
    want = _matmul_reference(q, q_scales, w, bias)
    for out_dtype, tol in [(torch.float32, _fp32_tol(device)), (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))]:
        got = fp8_matmul(q.to(device), q_scales.to(device), w.weight.to(device), w.scale.to(device),
                         bias.to(device), out_dtype)
        assert got.dtype == out_dtype
        torch.testing.assert_close(got.float().cpu(), want, **tol)
    got = fp8_matmul(q.to(device), q_scales.to(device), w.weight.to(device), w.scale.to(device), None, torch.float32)
    torch.testing.assert_close(got.cpu(), _matmul_reference(q, q_scales, w, None), **_fp32_tol(device))


def test_fp8_matmul_refuses_mismatched_scales():
    w = _weights(64, 256, True)
    q, s = quantize_rows(torch.randn(3, 256), None)  # per-row activation scales with a block-scaled weight
    with pytest.raises(ValueError, match=r"scales must be float32 \(3, 2\)"):
        fp8_matmul(q, s, w.weight, w.scale, None, torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(q.float(), s, w.weight, w.scale, None, torch.float32)


def test_matmul_config_grows_the_row_tile_with_m():
    assert [matmul_config(m)[0] for m in (1, 16, 17, 64, 65, 4096)] == [16, 16, 32, 64, 128, 128]
    assert all(matmul_config(m)[1] == 128 for m in (1, 4096))  # one weight scale block a column tile


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blockwise", [False, True], ids=["per-row", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_is_weight_only(device, blockwise, dtype, rows):
    """bf16/fp32 activations times the dequantized fp8 weight, with each prologue."""
    n, k = 136, 160
    w = _weights(n, k, blockwise)
    dense = w.dequantize()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    args = dict(weight_scale=w.scale.to(device))
    wd = w.weight.to(device)

    def ref(a, b=None):
        return F.linear(a.float(), dense, None if b is None else b.float()).to(dtype)

    torch.testing.assert_close(gemv(x.to(device), wd, bias.to(device), **args).cpu(), ref(x, bias), **_tol(dtype))
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    res = torch.randn(rows, k, generator=g).to(dtype)
    want_h, want_res = norm(x, res.clone())
    y, h = gemv(x.to(device), wd, None, "norm", res.to(device), norm.weight.detach().to(device), 1e-6, **args)
    torch.testing.assert_close(h.cpu(), want_res, **_tol(dtype))
    torch.testing.assert_close(y.cpu(), ref(want_h), **_tol(dtype))
    gate_up = torch.randn(rows, 2 * k, generator=g).to(dtype)
    torch.testing.assert_close(gemv(gate_up.to(device), wd, None, "silu", **args).cpu(), ref(silu_and_mul(gate_up)),
                               **_tol(dtype))


def test_fp8_gemv_refuses_a_weight_without_its_scale():
    w = _weights(64, 128, False)
    x = torch.zeros(1, 128)
    with pytest.raises(ValueError, match=r"needs weight_scale float32 \[64\] or \[1, 1\]"):
        gemv(x, w.weight)
    with pytest.raises(ValueError, match="goes with a float8_e4m3fn weight"):
        gemv(x, torch.zeros(64, 128), weight_scale=w.scale)
    with pytest.raises(ValueError, match="a float dtype"):
        gemv(x.double(), w.weight, weight_scale=w.scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["per-row bf16", "per-row fp32", "block bf16"])
def test_fp8_weight_takes_the_path_its_shape_asks_for(device, case):
    """Decode rows (<= 4): the weight-only GEMV, i.e. F.linear on the dequantized weight.
    More rows: the activations quantized per token (per 128-group for block weights), then
    torch._scaled_mm (per-row scales, bf16) or the Triton matmul: the float32 matmul of both
    dequantized operands."""
    blockwise, dtype = case.startswith("block"), torch.bfloat16 if case.endswith("bf16") else torch.float32
    n, k = 144, 256
    w = _weights(n, k, blockwise)
    layer = FP8Weight(w.to(device))
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(n, generator=g).to(dtype)
    tol = _fp32_tol(device) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    with gemv_on_cpu():
        for rows in (1, 4, 5, 33):
            x = torch.randn(rows, k, generator=g).to(dtype)
            got = layer.apply(x.to(device), bias.to(device)).cpu()
            if rows <= 4:
                want = F.linear(x.float(), w.dequantize(), bias.float())
            else:
                want = _matmul_reference(*quantize_rows(x, 128 if blockwise else None), w, bias)
            assert got.dtype == dtype and got.shape == (rows, n)
            torch.testing.assert_close(got.float(), want, **tol)
        # [B, T, K] inputs keep their leading dims
        x = torch.randn(2, 3, k, generator=g).to(dtype)
        assert layer.apply(x.to(device)).shape == (2, 3, n)


@pytest.mark.gpu
def test_fp8_weight_in_a_cuda_graph_replays_as_run():
    """No host sync, no shape-dependent surprise: captured at 1 row (GEMV) and 64 rows
    (quantize + _scaled_mm), per-row and block weights, replayed on new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for blockwise in (False, True):
        layer = FP8Weight(_weights(512, 1024, blockwise).to("cuda"))
        for rows in (1, 64):
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            layer.apply(x)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer.apply(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(y, layer.apply(x), atol=0, rtol=0)
