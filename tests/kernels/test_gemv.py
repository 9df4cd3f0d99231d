"""The small-batch GEMV kernel and its fused prologues against the plain-torch layer code
they replace (RMSNorm with residual, SiLU-and-mul, F.linear). CPU: Triton's interpreter;
`-m gpu`: CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels.gemv import MAX_ROWS, gemv, gemv_config  # noqa: E402
from ember.layers.activation import silu_and_mul  # noqa: E402
from ember.layers.norm import RMSNorm  # noqa: E402

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(autouse=True)
def plain_torch_reference():
    with cpu_kernels.disabled():
        yield


def _data(rows, n, k, dtype, seed=0, width=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width or k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return g, x, w, b


def _linear_ref(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The matmul in float32 over the rounded input, rounded once at the end."""
    return F.linear(a.float(), w.float(), None if b is None else b.float()).to(a.dtype)


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (2, 33, 64), (3, 64, 160), (4, 17, 32)])
def test_plain_matches_linear(device, dtype, rows, n, k):
    _, x, w, b = _data(rows, n, k, dtype)
    for bias in (None, b):
        got = gemv(x.to(device), w.to(device), None if bias is None else bias.to(device))
        torch.testing.assert_close(got.cpu(), _linear_ref(x, w, bias), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_prologue_matches_rms_norm_then_linear(device, dtype, rows):
    g, x, w, _ = _data(rows, 48, 80, dtype)
    norm = RMSNorm(80, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(80, generator=g)).to(dtype)
    res = torch.randn(rows, 80, generator=g).to(dtype)
    want_h, want_res = norm(x, res.clone())
    res_dev = res.to(device)
    y, h = gemv(x.to(device), w.to(device), prologue="norm", residual=res_dev,
                norm_weight=norm.weight.detach().to(device), eps=1e-6)
    # the residual stream: exact, one rounding of the float32 sum as torch's add
    torch.testing.assert_close(h.cpu(), want_res, atol=0, rtol=0)
    torch.testing.assert_close(res_dev.cpu(), res)  # and a new tensor: the old one is untouched
    torch.testing.assert_close(y.cpu(), _linear_ref(want_h, w, None), **_tol(dtype))
    # the first layer: no residual yet, h is x itself
    y0, h0 = gemv(x.to(device), w.to(device), prologue="norm", norm_weight=norm.weight.detach().to(device),
                  eps=1e-6)
    assert h0.data_ptr() != 0 and torch.equal(h0.cpu(), x)
    torch.testing.assert_close(y0.cpu(), _linear_ref(norm(x), w, None), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", [(1, 72), (4, 64)])
def test_silu_prologue_matches_silu_and_mul_then_linear(device, dtype, rows, k):
    _, gate_up, w, _ = _data(rows, 24, k, dtype, width=2 * k)
    got = gemv(gate_up.to(device), w.to(device), prologue="silu")
    torch.testing.assert_close(got.cpu(), _linear_ref(silu_and_mul(gate_up), w, None), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_every_block_config(device):
    """x may be a view with a row stride (a slice of a bigger buffer); explicit configs that
    cover N and K with partial tiles give the same answer."""
    _, big, w, _ = _data(2, 20, 48, torch.float32, width=100)
    x = big[:, 10:58]
    want = _linear_ref(x, w, None)
    for config in [(4, 16, 1), (8, 32, 2), (32, 64, 4)]:
        torch.testing.assert_close(gemv(x.to(device), w.to(device), config=config).cpu(), want, atol=1e-5, rtol=1e-5)


def test_config_fits_the_accumulator_and_fills_the_gpu():
    for rows in range(1, MAX_ROWS + 1):
        for n, k in [(4096, 1024), (1024, 2048), (6144, 4096), (4096, 14336), (128256, 4096), (576, 1536)]:
            block_n, block_k, warps = gemv_config(rows, n, k)
            m_pad = 1 << (rows - 1).bit_length()
            assert m_pad * block_n * block_k <= 8192 and block_n >= 4 and warps in (4, 8)
            interp_n, interp_k, _ = gemv_config(rows, n, k, fill_gpu=False)
            assert interp_n * m_pad * interp_k == 8192
    # one row: the H200 sweep's best at the Qwen3-0.6B shapes
    assert gemv_config(1, 4096, 1024) == (4, 512, 4)  # q|k|v: 1024 programs
    assert gemv_config(1, 1024, 2048) == (8, 1024, 8)  # o_proj: few rows, long tiles
    assert gemv_config(4, 128256, 4096) == (16, 128, 4)


def test_layers_send_one_row_of_a_small_weight():
    from ember.layers.linear import gemv_on_cpu, uses_gemv

    w, big = torch.zeros(64, 32), torch.zeros(1 << 12, 1 << 12 | 1)
    assert not uses_gemv(torch.zeros(1, 32), w)  # CPU tensors: only when forced (tests)
    with gemv_on_cpu():
        assert uses_gemv(torch.zeros(1, 32), w)
        assert not uses_gemv(torch.zeros(2, 32), w)  # cuBLAS won from 2 rows up
        assert not uses_gemv(torch.zeros(1, big.shape[1]), big)  # and for weights > 2^24 elements
        assert not uses_gemv(torch.zeros(1, 32, dtype=torch.float64), w)


def test_bad_input_is_refused():
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        gemv(torch.zeros(5, 8), w)
    with pytest.raises(ValueError, match="prologue must be"):
        gemv(x, w, prologue="gelu")
    with pytest.raises(ValueError, match=r"x must be \[M, 16\]"):
        gemv(x, w, prologue="silu")
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, prologue="norm")
    with pytest.raises(ValueError, match="residual goes with"):
        gemv(x, w, residual=x)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, w, torch.zeros(3))
