"""The integer-weight kernels (W4A16 / W8A16: kernels/wna16.py's tensor-core matmul, the word
GEMV of kernels/int_gemv.py and the per-value one of kernels/gemv.py, with their prologues) and
IntWeight's choice of them (layers/quant/
int_weight.py) against plain torch: x times the weight dequantized to float32 (the reference
every format's reader reproduces exactly, tests/layers/test_int_weights.py). Odd shapes (rows,
columns and K not multiples of the tiles, a last group cut short), every group size (32, 64,
128, one a row, and 48 and 40, which no power-of-two tile divides), zero points or none,
act-order g_idx, 4 and 8 bits. CPU: Triton's interpreter; `-m gpu`: CUDA at Llama-3.1-8B's
shapes, and the layer captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hopper_compile import run_compile_script

pytest.importorskip("triton")

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels import int_gemv as int_gemv_module  # noqa: E402
from ember.kernels import wna16 as wna16_module  # noqa: E402
from ember.kernels.gemv import gemv  # noqa: E402
from ember.kernels.int_gemv import int_gemv, int_gemv_config, words_kernel_takes  # noqa: E402
from ember.kernels.wna16 import matmul_path, wna16_config, wna16_matmul  # noqa: E402
from ember.layers.activation import silu_and_mul  # noqa: E402
from ember.layers.kernel_paths import gemv_on_cpu  # noqa: E402
from ember.layers.norm import RMSNorm  # noqa: E402
from ember.layers.quant.int_weight import IntTensor, IntWeight  # noqa: E402

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(autouse=True)
def plain_torch_reference():
    with cpu_kernels.disabled():
        yield


def int_weight(n: int, k: int, bits: int, group: int, zeros: bool, act_order: bool, seed: int = 0,
               device: str = "cpu", scale_dtype: torch.dtype = torch.float16) -> IntTensor:
    """Random integers, scales of about 1 / (2^bits sqrt(K)) (outputs of about 1 for x of about 1),
    random zero points; act_order: the columns dealt to groups in a random order."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group == -1 else group
    groups = -(-k // gs)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scales = ((0.5 + torch.rand(n, groups, generator=g)) * 2 / ((1 << bits) * k ** 0.5)).to(scale_dtype)
    z = torch.randint(0, 1 << bits, (n, groups), generator=g) if zeros else None
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=g)] = (torch.arange(k) // gs).to(torch.int32)
    return IntTensor.from_values(q, scales, z, g_idx, bits, gs).to(device)


def _reference(x: torch.Tensor, t: IntTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 matmul over the dequantized weight (and x as given, rounded or not)."""
    return F.linear(x.float().cpu(), t.to("cpu").dequantize(), None if bias is None else bias.float().cpu())


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """float32: the order of a float32 sum; bfloat16: the output's rounding and, per column
    (act-order), the weight's to bfloat16 (2^-9 each)."""
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


# (bits, group, zero points, act-order): each kernel path, and both odd groups
CASES = [(4, 32, False, False), (4, 64, True, False), (4, 128, True, False), (4, -1, False, False),
         (8, 128, False, False), (8, -1, True, False), (4, 48, True, False), (4, 40, False, False),
         (4, 64, True, True), (8, 32, False, True)]


def _ids(case) -> str:
    bits, group, zeros, act = case
    return f"{bits}bit-g{group}{'-zeros' if zeros else ''}{'-actorder' if act else ''}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_is_x_times_the_dequantized_weight(device, case, dtype):
    bits, group, zeros, act = case
    n, k = 200, 328  # partial tiles both ways; K: 41 words of 4-bit values, a last group cut short
    t = int_weight(n, k, bits, group, zeros, act, device=device)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    for rows, b in [(1, bias), (17, None), (40, bias)]:
        x = torch.randn(rows, k, generator=g).to(dtype).to(device)
        got = wna16_matmul(x, t.qweight, t.scales, t.zeros, t.g_idx, t.bits, t.group_size, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float().cpu(), _reference(x, t, b), **_tol(dtype))
    assert wna16_matmul(x[:0], t.qweight, t.scales, t.zeros, t.g_idx, t.bits, t.group_size).shape == (0, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_with_integer_weights_and_each_prologue(device, case, rows):
    """The GEMV on the dequantized weight, after the norm (with the residual) and SiLU prologues."""
    bits, group, zeros, act = case
    dtype = torch.bfloat16
    n, k = 136, 160
    t = int_weight(n, k, bits, group, zeros, act, device=device)
    args = dict(weight_scale=t.scales, weight_zeros=t.zeros, g_idx=t.g_idx, bits=t.bits, group_size=t.group_size)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)

    def ref(a, b=None):
        return _reference(a, t, b).to(dtype)

    got = gemv(x.to(device), t.qweight, bias.to(device), **args)
    torch.testing.assert_close(got.cpu(), ref(x, bias), **_tol(dtype))
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    res = torch.randn(rows, k, generator=g).to(dtype)
    want_h, want_res = norm(x, res.clone())
    y, h = gemv(x.to(device), t.qweight, None, "norm", res.to(device), norm.weight.detach().to(device), 1e-6, **args)
    torch.testing.assert_close(h.cpu(), want_res, **_tol(dtype))
    torch.testing.assert_close(y.cpu(), ref(want_h), **_tol(dtype))
    gate_up = torch.randn(rows, 2 * k, generator=g).to(dtype)
    got = gemv(gate_up.to(device), t.qweight, None, "silu", **args)
    torch.testing.assert_close(got.cpu(), ref(silu_and_mul(gate_up)), **_tol(dtype))


# (case, rows): the word kernel at every group kind (32, 64, 128, one a row, 48 and 40 words
# of 6 and 5, K = 164 ending mid-word), act-order sorted by group (x read through the order),
# and 1 to 8 rows
WORD_CASES = [((4, 32, False, False), 1), ((4, 64, True, False), 2), ((4, 128, True, False), 3),
              ((4, -1, False, False), 4), ((8, 128, False, False), 2), ((8, -1, True, False), 1),
              ((4, 48, True, False), 4), ((4, 40, False, False), 3), ((8, 32, True, False), 8),
              ((4, 64, True, True), 1), ((8, 32, False, True), 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,rows", WORD_CASES, ids=[f"{_ids(c)}-{r}rows" for c, r in WORD_CASES])
def test_word_gemv_and_each_prologue(device, case, rows):
    """int_gemv (what IntWeight's GEMV calls) on the dequantized weight, after the norm (with the
    residual, which comes back exact) and SiLU prologues; x in float32 at 8 rows; an act-order
    weight sorted by group, with x's columns in the order taken."""
    bits, group, zeros, act = case
    dtype = torch.float32 if rows == 8 else torch.bfloat16
    n, k = 75, 164
    t = int_weight(n, k, bits, group, zeros, act, device=device)
    assert words_kernel_takes(t.bits, t.group_size, k, t.g_idx) == (not act)
    kernel_t, perm = t.sorted_by_group() if act else (t, None)
    assert words_kernel_takes(kernel_t.bits, kernel_t.group_size, k, kernel_t.g_idx)
    perm = None if perm is None else perm.to(torch.int32)
    args = (kernel_t.qweight, kernel_t.scales, kernel_t.zeros, None, bits, kernel_t.group_size)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)

    def ref(a, b=None):
        return _reference(a, t, b).to(dtype)

    got = int_gemv(x.to(device), *args, bias.to(device), perm=perm)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.cpu(), ref(x, bias), **_tol(dtype))
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    res = torch.randn(rows, k, generator=g).to(dtype)
    want_h, want_res = norm(x, res.clone())
    y, h = int_gemv(x.to(device), *args, None, "norm", res.to(device), norm.weight.detach().to(device), 1e-6, perm)
    torch.testing.assert_close(h.cpu(), want_res, atol=0, rtol=0)
    torch.testing.assert_close(y.cpu(), ref(want_h), **_tol(dtype))
    gate_up = torch.randn(rows, 2 * k, generator=g).to(dtype)
    got = int_gemv(gate_up.to(device), *args, None, "silu", perm=perm)
    torch.testing.assert_close(got.cpu(), ref(silu_and_mul(gate_up)), **_tol(dtype))


def test_word_gemv_config_and_what_it_refuses(monkeypatch):
    """The tile: BLOCK_J halves as the rows double, BLOCK_N and the warps shrink (to 4 and 2) while
    the programs would not fill the H100 twice, unless the sweep's TUNED table names one; groups that cut a word and
    act-order go to gemv.py's kernel."""
    monkeypatch.setattr(int_gemv_module, "TUNED", {(4, 28672, 4096): (32, 64, 4, 2)})
    assert int_gemv_config(3, 28672, 4096, 4) == (32, 64, 4, 2) != int_gemv_config(3, 28672, 4096, 8)
    assert int_gemv_config(1, 28672, 4096, 4) == (16, 256, 8, 3)
    assert int_gemv_config(1, 4096, 14336, 4) == (8, 256, 4, 3)
    assert [int_gemv_config(m, 6144, 4096, 4)[1] for m in (1, 2, 3, 4, 8)] == [256, 128, 64, 64, 32]
    assert int_gemv_config(1, 64, 40, 4) == (4, 8, 2, 3)  # K = 40: 5 words, one tile of 8
    assert words_kernel_takes(4, 128, 4096, None) and words_kernel_takes(8, 4096, 4096, None)
    assert not words_kernel_takes(4, 20, 4096, None)  # a group of 2.5 words
    assert not words_kernel_takes(4, 128, 4096, torch.zeros(4096, dtype=torch.int32))
    t = int_weight(16, 64, 4, 32, True, False)
    with pytest.raises(ValueError, match="the integer GEMV takes 1 to 8 rows, got 9: use wna16_matmul"):
        int_gemv(torch.randn(9, 64), t.qweight, t.scales, t.zeros, None, 4, 32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] float"):
        int_gemv(torch.randn(2, 64).half().int(), t.qweight, t.scales, t.zeros, None, 4, 32)
    with pytest.raises(ValueError, match=r"scales must be float \[16, 4\]"):  # groups of 16 need 4 scales a row
        int_gemv(torch.randn(1, 64), t.qweight, t.scales, t.zeros, None, 4, 16)
    with pytest.raises(ValueError, match=r"perm must be int32 \[64\]"):
        int_gemv(torch.randn(1, 64), t.qweight, t.scales, t.zeros, None, 4, 32, perm=torch.arange(64))
    with pytest.raises(ValueError, match="perm goes with weights the word kernel takes"):
        int_gemv(torch.randn(1, 64), t.qweight, t.scales, t.zeros, torch.zeros(64, dtype=torch.int32), 4, 32,
                 perm=torch.arange(64, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", [False, True], ids=["grouped", "actorder"])
def test_int_weight_takes_the_path_its_rows_ask_for(device, act):
    """Up to 2 rows the GEMV, more the tensor-core matmul; [B, T, K] inputs keep their dims;
    off the CUDA paths, F.linear on the dequantized weight. An act-order weight is held sorted
    by group, its order beside it."""
    t = int_weight(144, 256, 4, 64 if act else 128, True, act, device=device)
    layer = IntWeight(t)
    assert (layer.order is not None) == act and layer.tensor.g_idx is None
    torch.testing.assert_close(layer.dequantize(torch.float32), t.dequantize(), atol=0, rtol=0)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(144, generator=g).to(device)
    with gemv_on_cpu():
        for rows in (1, 2, 3, 33):
            x = torch.randn(rows, 256, generator=g).to(device)
            assert layer.uses_gemv(x) == (rows <= 2)
            torch.testing.assert_close(layer.apply(x, bias).cpu(), _reference(x, t, bias), **_tol(torch.float32))
        assert layer.apply(torch.randn(2, 3, 256).to(device)).shape == (2, 3, 144)
    x = torch.randn(3, 256).to(device)
    if device == "cpu":
        torch.testing.assert_close(layer.apply(x), _reference(x, t), rtol=1e-5, atol=1e-5)
    assert layer.nbytes == t.qweight.nbytes + t.scales.nbytes + t.zeros.nbytes + (256 * 4 if act else 0)


def test_matmul_config_grows_the_row_tile_and_kernels_refuse_what_does_not_fit(monkeypatch):
    """The row tile grows with M; fewer weight rows a program where the programs would not fill the
    H100 twice, unless the sweep's TUNED table names a tile; the tile lies inside a group (or the
    per-column path takes it, at most 64 of K a step)."""
    monkeypatch.setattr(wna16_module, "TUNED", {})  # the heuristic first
    assert [wna16_config(m, 6144, 4096)[0] for m in (1, 16, 17, 64, 65, 4096)] == [16, 16, 32, 64, 128, 128]
    assert wna16_config(4, 4096, 4096) == (16, 32, 128, 4, 4) and wna16_config(4, 28672, 4096)[1] == 64
    assert wna16_config(512, 4096, 4096) == (128, 64, 64, 4, 4)  # 4 x 32 tiles of 128 x 128: under 264
    assert wna16_config(512, 28672, 4096) == wna16_config(2048, 4096, 4096) == (128, 128, 64, 8, 4)
    monkeypatch.setattr(wna16_module, "TUNED", {(512, 4096, 4096): (64, 128, 64, 4, 3)})
    assert wna16_config(300, 4096, 4096) == (64, 128, 64, 4, 3) != wna16_config(300, 4096, 4096, bits=8)
    assert matmul_path(128, 4096, False, 128) == (True, 128) and matmul_path(32, 4096, False, 128) == (True, 32)
    assert matmul_path(48, 4096, False, 128) == (False, 64) and matmul_path(40, 4096, False, 128) == (False, 64)
    assert matmul_path(128, 4096, True, 128) == (False, 64) and matmul_path(4096, 4096, False, 64) == (True, 64)
    t = int_weight(64, 128, 4, 32, True, False)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"scales must be float \[64, 4\]"):
        wna16_matmul(x, t.qweight, t.scales[:, :2], t.zeros, None, 4, 32)
    with pytest.raises(ValueError, match=r"zeros must be uint8 \(64, 4\)"):
        wna16_matmul(x, t.qweight, t.scales, t.zeros.int(), None, 4, 32)
    with pytest.raises(ValueError, match=r"qweight must be int32 \[64, 15\] with contiguous rows for 4-bit values of K=120"):
        wna16_matmul(torch.randn(2, 120), t.qweight, t.scales, t.zeros, None, 4, 32)
    with pytest.raises(ValueError, match="integer weights of 4 or 8 bits; got 3"):
        gemv(x, t.qweight, weight_scale=t.scales, weight_zeros=t.zeros, bits=3, group_size=32)
    with pytest.raises(ValueError, match=r"g_idx must be int32 \[128\]"):
        wna16_matmul(x, t.qweight, t.scales, t.zeros, torch.zeros(128, dtype=torch.int64), 4, 32)


# Llama-3.1-8B's linear layers: q|k|v, o, gate|up, down
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("case", [(4, 128, False, False), (4, 128, True, False), (4, 128, True, True),
                                  (8, -1, False, False)], ids=_ids)
def test_llama_8b_shapes_on_the_gpu(n, k, case):
    """bf16 activations at decode (GEMV, 1 and 4 rows) and prefill (16 .. 512 rows: each tile
    wna16_config picks at these shapes) sizes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bits, group, zeros, act = case
    t = int_weight(n, k, bits, group, zeros, act, device="cuda")
    layer = IntWeight(t)
    dense = t.dequantize()
    g = torch.Generator(device="cuda").manual_seed(4)
    for rows in (1, 4, 16, 32, 64, 512):
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        want = F.linear(x.float(), dense)
        got = layer.apply(x).float()
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_int_weight_in_a_cuda_graph_replays_as_run():
    """No host sync, no shape-dependent surprise: captured at 1 row (GEMV) and 64 rows (the
    matmul), grouped and act-order weights, replayed on new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for act in (False, True):
        layer = IntWeight(int_weight(4096, 4096, 4, 128, True, act, device="cuda"))
        for rows in (1, 64):
            x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
            layer.apply(x)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer.apply(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(y, layer.apply(x), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("zeros", [True, False], ids=["awq", "gptq"])
def test_word_gemv_at_llama_8b_shapes(n, k, zeros):
    """int_gemv at 1, 2, 4 and 8 rows, 4 bits in groups of 128, with the prologue decode fuses
    into each layer (norm before q|k|v and gate|up, SiLU before down, none before o)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = int_weight(n, k, 4, 128, zeros, False, device="cuda")
    args = (t.qweight, t.scales, t.zeros, None, 4, 128)
    dense = t.dequantize()
    g = torch.Generator(device="cuda").manual_seed(6)
    nw = (1 + 0.1 * torch.randn(k, generator=g, device="cuda")).to(torch.bfloat16)
    for rows in (1, 2, 4, 8):
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        res = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        if k == 14336:  # down: x = silu(gate) * up
            gate_up = torch.randn(rows, 2 * k, generator=g, device="cuda").to(torch.bfloat16)
            got, a = int_gemv(gate_up, *args, prologue="silu"), silu_and_mul(gate_up)
        elif n == 4096:  # o
            got, a = int_gemv(x, *args), x
        else:
            norm = RMSNorm(k, 1e-6).cuda()
            norm.weight.data = nw
            a, want_res = norm(x, res.clone())
            got, h = int_gemv(x, *args, prologue="norm", residual=res, norm_weight=nw, eps=1e-6)
            torch.testing.assert_close(h, want_res, atol=0, rtol=0)
        torch.testing.assert_close(got.float(), F.linear(a.float(), dense), atol=3e-2, rtol=2e-2)


_COMPILE = """
import re
import sys

import triton

sys.path.insert(0, "tests/kernels")
from hopper_compile import compile_aligned, sass_counts, sass_text

from ember.kernels.int_gemv import PROGRAMS_AN_SM, _int_gemv_kernel, int_gemv_config, int_gemv_registers

H100_SHARED = 232448  # bytes of shared memory a program may take on the H100 (sm_90)
types = {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "p_ptr": "*i32", "eps": "fp32"}


def programs_an_sm(regs, warps):
    return 65536 // (-(-regs // 8) * 8 * 32 * warps)


def compiled(n, k, rows, prologue, perm, zeros, bits=4):
    block_n, block_j, warps, stages = int_gemv_config(rows, n, k, bits)
    constants = dict(M=rows, M_PAD=triton.next_power_of_2(rows), K=k, BITS=bits, GROUP=128, HAS_ZEROS=zeros,
                     BLOCK_N=block_n, BLOCK_J=block_j, CHUNK=min(block_j, 128 * bits // 32),  # a group's words
                     PROLOGUE=prologue, HAS_RES=prologue == 1, HAS_BIAS=False, HAS_PERM=perm, STAGES=stages)
    cap = int_gemv_registers(rows, warps, bits, perm)  # as int_gemv launches it
    options = {"num_warps": warps} | ({"maxnreg": cap} if cap else {})
    return compile_aligned(_int_gemv_kernel, constants, types, options), warps, -(-(k * bits // 32) // block_j)


for (n, k), prologue, perm in (((6144, 4096), 1, False), ((4096, 4096), 0, False), ((4096, 14336), 2, False),
                               ((6144, 4096), 1, True)):
    for rows in (1, 2, 4, 8):
        kernel, warps, tiles = compiled(n, k, rows, prologue, perm, True)
        ptx, what = kernel.asm["ptx"], f"the word GEMV at [{n}, {k}], {rows} rows, prologue {prologue}, perm {perm}"
        counts = sass_counts(kernel.asm["cubin"])
        assert counts["STACK"] == counts["STL"] == counts["LDL"] == 0, f"{what} spills registers: {counts}"
        assert kernel.metadata.shared <= H100_SHARED, f"{what}: {kernel.metadata.shared} bytes of shared memory"
        assert not re.search(r"cvt\\.rn\\.f32\\.[su]32", ptx), f"{what} converts 32-bit integers to float"
        if tiles > 1:  # a loop over K (the tuned one-row tiles of K = 4096 take a row's 512 words at once: no loop)
            assert "cp.async.c" in ptx, f"{what}: no load is software-pipelined (cp.async)"
            # the zero points a tile ahead: the first tile's loaded before the loop (its backward branch's target)
            sass = sass_text(kernel.asm["cubin"])
            branches = re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?BRA 0x([0-9a-f]+)", sass)
            loop = min(int(to, 16) for at, to in branches if int(to, 16) < int(at, 16))
            zero_loads = [int(a, 16) for a in re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?LDG\\.E[.\\w]*\\.U8\\s",
                                                         sass)]
            assert zero_loads and min(zero_loads) < loop, f"{what}: the first zero points are loaded in the loop"
        if rows == 1 and not perm:  # decode's one request: zero points (AWQ) cost no program an SM (GPTQ's none)
            symmetric = sass_counts(compiled(n, k, rows, prologue, perm, False)[0].asm["cubin"])
            awq, gptq = programs_an_sm(counts["REG"], warps), programs_an_sm(symmetric["REG"], warps)
            assert awq == gptq >= PROGRAMS_AN_SM, f"{what}: {awq} programs an SM ({counts['REG']} registers) " \\
                f"with zero points, {gptq} ({symmetric['REG']}) without"
for (n, k), prologue in (((28672, 4096), 1), ((4096, 14336), 2)):  # 8 bits: reasoned tiles, no cap
    assert int_gemv_registers(1, 8, 8) is None
    kernel, warps, _ = compiled(n, k, 1, prologue, False, True, bits=8)
    counts = sass_counts(kernel.asm["cubin"])
    assert counts["STACK"] == counts["STL"] == counts["LDL"] == 0, f"8 bits at [{n}, {k}] spill: {counts}"
print("compiled")
"""


@pytest.mark.slow
def test_the_word_gemv_compiles_for_hopper():
    """Triton compiles the word GEMV at Llama-3.1-8B's shapes, 1 to 8 rows, with each prologue
    (and the norm's through an act-order permutation) to sm_90 here, without a GPU, at the tiles
    int_gemv_config picks and the register cap int_gemv_registers sets: no register spills in the
    SASS, within the H100's shared memory, its loads software-pipelined (cp.async) where it loops over K, and no 32-bit
    integer -> float conversion (only the uint8 zero points convert). At one row (weights in K
    order), zero points (AWQ) leave as many programs an SM as the symmetric kernel (GPTQ), and at least
    PROGRAMS_AN_SM: uncapped, ptxas gave the norm prologue's kernel 96 registers with zero
    points (two programs of 8 warps an SM) and 79 without (three)."""
    assert "compiled" in run_compile_script(_COMPILE)


_COMPILE_MATMUL = """
import sys

sys.path.insert(0, "tests/kernels")
from hopper_compile import compile_aligned, sass_counts

from ember.kernels.wna16 import _wna16_matmul_kernel, matmul_path, wna16_config

H100_SHARED = 232448  # bytes of shared memory a program may take on the H100 (sm_90)
types = {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32"}
configs = {wna16_config(rows, n, k): (n, k) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
           for rows in (2 ** i for i in range(14))}
assert len(configs) >= 4, configs
for config, (n, k) in sorted(configs.items()):
    block_m, block_n, block_k, warps, stages = config
    for kind, bits, zeros in (("awq", 4, True), ("gptq", 4, False), ("per column", 4, True), ("8-bit", 8, True)):
        grouped, tile_k = matmul_path(128, k, kind == "per column", block_k)
        constants = dict(K=k, BITS=bits, GROUP=128, GROUPED=grouped, HAS_ZEROS=zeros, HAS_G_IDX=not grouped,
                         HAS_BIAS=False, PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=tile_k, GROUP_M=8)
        compiled = compile_aligned(_wna16_matmul_kernel, constants, types, {"num_warps": warps, "num_stages": stages})
        counts, what = sass_counts(compiled.asm["cubin"]), f"the matmul ({kind}) at {config}"
        assert counts["STACK"] == counts["STL"] == counts["LDL"] == 0, f"{what} spills registers: {counts}"
        assert 2 * counts["REG"] * 32 * warps <= 65536, f"{what}: {counts['REG']} registers, one program an SM"
        assert compiled.metadata.shared <= H100_SHARED, f"{what}: {compiled.metadata.shared} bytes of shared memory"
        ptx = compiled.asm["ptx"]
        assert ("wgmma.mma_async" if block_m >= 64 else "mma.sync") in ptx, f"{what}: not on tensor cores"
print("compiled")
"""


@pytest.mark.slow
def test_the_matmul_compiles_for_hopper_without_spills():
    """Triton compiles the matmul at every tile wna16_config picks for Llama-3.1-8B's shapes (1 to
    8192 rows), grouped (AWQ with zero points, GPTQ without, 8 bits) and per column, to sm_90 SASS here,
    without a GPU: no register spills (ptxas spills show in the SASS, not the PTX), registers
    for two programs an SM, within the H100's shared memory, on tensor cores (wgmma from 64 rows)."""
    assert "compiled" in run_compile_script(_COMPILE_MATMUL)
