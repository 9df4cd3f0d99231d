"""The W8A8 kernels (kernels/int8.py: per-token activation quantization, the INT8 x INT8 -> int32
matmul with the scales and bias in its epilogue) and W8A8Weight on the CUDA paths, against the
plain-torch reference of the scheme (tests/w8a8_checkpoints.py): the same bits, since the int32
sums are exact and both round and scale alike. Odd shapes (rows, columns and K off every tile),
dynamic and static activations, float32 and bfloat16. CPU: Triton's interpreter; `-m gpu`: CUDA
at Llama-3.1-8B's shapes, and in a CUDA graph; and (slow) both kernels compile for the H100."""

from __future__ import annotations

import pytest
import torch
from hopper_compile import run_compile_script
from w8a8_checkpoints import reference_linear, reference_quantize

pytest.importorskip("triton")

from ember.kernels.int8 import int8_config, int8_matmul, quantize_tokens  # noqa: E402
from ember.layers.kernel_paths import gemv_on_cpu  # noqa: E402
from ember.layers.quant.w8a8 import AMAX_FLOOR, W8A8Tensor, W8A8Weight  # noqa: E402

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _skip_without_cuda(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _weight(n: int, k: int, static: float | None = None, seed: int = 0) -> W8A8Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (0.5 + torch.rand(n, generator=g)) / (127 * k ** 0.5)
    return W8A8Tensor(q, scale, None if static is None else torch.tensor([static]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, 0.02], ids=["dynamic", "static"])
def test_quantize_tokens_is_the_reference_bit_for_bit(device, dtype, static):
    _skip_without_cuda(device)
    g = torch.Generator().manual_seed(1)
    for rows, k in [(1, 37), (5, 328), (3, 16400)]:  # 16400: past the widest block (16384), two passes
        x = (3 * torch.randn(rows, k, generator=g)).to(dtype)
        x[0, :5] = torch.tensor([0.5, 1.5, -2.5, 200.0, -300.0]) * (static or 1)  # ties; static: out of range
        if rows > 2:
            x[2] = 0  # a row of zeros: scale AMAX_FLOOR / 127
        scale = None if static is None else torch.tensor([static], device=device)
        q, s = quantize_tokens(x.to(device), scale, AMAX_FLOOR)
        want_q, want_s = reference_quantize(x, static)
        assert q.dtype == torch.int8 and s.shape == (rows, 1)
        assert torch.equal(q.cpu(), want_q.to(torch.int8)) and torch.equal(s.cpu(), want_s)
    assert quantize_tokens(x[:0].to(device), scale, AMAX_FLOOR)[0].shape == (0, 16400)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_is_the_reference_bit_for_bit(device, dtype):
    _skip_without_cuda(device)
    n, k = 200, 328  # partial tiles both ways
    t = _weight(n, k).to(device)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=g).to(dtype)
    for rows, b in [(1, bias), (17, None), (40, bias)]:
        x = torch.randn(rows, k, generator=g).to(dtype)
        q, s = reference_quantize(x)
        got = int8_matmul(q.to(torch.int8).to(device), s.to(device), t.weight, t.scale,
                          None if b is None else b.to(device), dtype)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = reference_linear(x, t.weight.cpu(), t.scale.cpu(), None, b).to(dtype)
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("static", [None, 0.05], ids=["dynamic", "static"])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(static):
    """W8A8Weight on the CUDA paths (the interpreter): 1, 3, 17 and 40 rows (row tiles of 16 and
    32), each row equal to the reference and to itself alone; [B, T, K] keeps its dims."""
    t = _weight(72, 100, static)
    layer = W8A8Weight(t)
    x = torch.randn(40, 100, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(72)
    want = reference_linear(x, t.weight, t.scale, static, bias)
    with gemv_on_cpu():
        alone = torch.cat([layer.apply(x[i:i + 1], bias) for i in range(40)])
        for rows in (3, 17, 40):
            assert torch.equal(layer.apply(x[:rows], bias), alone[:rows])
        assert layer.apply(x.view(2, 20, 100)).shape == (2, 20, 72)
    assert torch.equal(alone, want)


def test_config_and_refusals():
    # Llama-8B's o (4096 rows): the largest tile that makes MIN_PROGRAMS programs
    assert [int8_config(m, 4096)[:3] for m in (1, 16, 17, 64, 256, 512, 1024)] == [
        (16, 32, 256), (16, 32, 256), (32, 64, 128), (64, 64, 128), (64, 64, 128), (64, 128, 128), (128, 128, 128)]
    assert int8_config(1, 28672)[:3] == (16, 128, 256) and int8_config(64, 28672)[:3] == (64, 128, 128)
    assert int8_config(512, 6144)[:3] == (128, 128, 128) and int8_config(256, 6144)[:3] == (64, 128, 128)  # q|k|v
    t = _weight(64, 128)
    q = torch.zeros(2, 128, dtype=torch.int8)
    s = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"q \[M, K\] and weight \[N, K\] must be int8"):
        int8_matmul(q.float(), s, t.weight, t.scale, None, torch.float32)
    with pytest.raises(ValueError, match=r"scales must be float32 \(2, 1\) and \(64,\)"):
        int8_matmul(q, s, t.weight, t.scale[:10], None, torch.float32)
    with pytest.raises(ValueError, match="a static input scale is one float32"):
        quantize_tokens(torch.zeros(2, 8), torch.ones(2), AMAX_FLOOR)


# Llama-3.1-8B's linear layers: q|k|v, o, gate|up, down
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("static", [None, 0.05], ids=["dynamic", "static"])
def test_llama_8b_shapes_on_the_gpu(n, k, static):
    """bf16 activations at decode (1, 4, 16 rows) and prefill (64, 512, 2048) sizes: the
    reference's bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = _weight(n, k, static).to("cuda")
    layer = W8A8Weight(t)
    g = torch.Generator(device="cuda").manual_seed(4)
    for rows in (1, 4, 16, 64, 512, 2048):
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        want = reference_linear(x, t.weight, t.scale, static).to(torch.bfloat16)
        assert torch.equal(layer.apply(x), want), rows


@pytest.mark.gpu
def test_w8a8_in_a_cuda_graph_replays_as_run():
    """No host sync: captured at 1 row and at 64, dynamic and static, replayed on new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for static in (None, 0.05):
        layer = W8A8Weight(_weight(4096, 4096, static).to("cuda"))
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
            assert torch.equal(y, layer.apply(x))


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels.int8 import _int8_matmul_kernel, _quantize_tokens_kernel, int8_config

H100_SHARED = 232448  # bytes of shared memory a program may take on the H100 (sm_90)
names = list(_int8_matmul_kernel.arg_names)
pointers = {"q_ptr": "*i8", "qs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
for rows in (1, 64, 512):
    block_m, block_n, block_k, warps, stages = int8_config(rows, 28672)
    constants = dict(K=4096, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8)
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
    source = ASTSource(_int8_matmul_kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    assert ("mma" in ptx and ".s8" in ptx), f"no int8 tensor-core instruction at {rows} rows"
    assert "fma.rn.f32" not in ptx, "the epilogue fused a multiply and an add"
    assert "st.local" not in ptx, f"registers spill at {rows} rows"
    assert compiled.metadata.shared <= H100_SHARED, f"{compiled.metadata.shared} bytes of shared memory"
names = list(_quantize_tokens_kernel.arg_names)
for static, k, block, warps in ((False, 4096, 4096, 4), (True, 4096, 4096, 4), (False, 14336, 16384, 16),
                                (False, 20000, 16384, 16)):  # a row in registers (one read), or two passes
    constants = dict(K=k, STATIC=static, QMIN=-128.0 if static else -127.0, BLOCK=block)
    types = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "in_scale_ptr": "*fp32", "amax_floor": "fp32"}
    signature = {n: types.get(n, "constexpr" if n in constants else "i32") for n in names}
    source = ASTSource(_quantize_tokens_kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "st.local" not in compiled.asm["ptx"], f"quantize_tokens spills registers at K={k}"
print("compiled")
"""


@pytest.mark.slow
def test_the_kernels_compile_for_hopper():
    """Triton compiles the matmul at decode and prefill tiles and both quantization modes to
    sm_90 PTX here, without a GPU: the matmul on int8 tensor cores, no FMA in its epilogue, no
    register spills, within the H100's shared memory."""
    assert "compiled" in run_compile_script(_COMPILE)
